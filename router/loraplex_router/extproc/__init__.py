"""The router as a Gateway API Inference Extension endpoint picker (EPP): Envoy's ext_proc v3
`Process` stream, served on its own port by the router process (`loraplex router --extproc-port`).

The gateway (Istio, kgateway, any Envoy ext_proc speaker) streams each request's headers and body
here; the picker runs the router's own filters -> scorers -> picker over the same routing-table
snapshot, demand counters, in-flight counts and outlier detector as the HTTP proxy, and answers with
the chosen agent in the `x-gateway-destination-endpoint` header and the `envoy.lb` dynamic metadata.
The gateway then forwards the request to that agent itself. docs/gateway.md.
"""
