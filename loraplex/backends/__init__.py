"""Engine backends other than our own: what the agent and the operator share to run them.

`vllm` builds the command line of an unmodified vLLM OpenAI server from a pool's settings;
`loraplex_vllm` is the plug-in module that server loads (standard library only: it runs in vLLM's
interpreter, copied there by the agent or mounted from a ConfigMap by the operator).
"""
