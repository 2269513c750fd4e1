"""Files served over HTTP as the Hugging Face Hub lays them out (/<repo>/resolve/<revision>/<file>),
for the operator's source inspector: `with hub_files({path: bytes}) as url:`."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any


@contextmanager
def hub_files(files: Mapping[str, bytes]) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 answering GET `path` with `files[path]` (404 for any other path)."""

    class Files(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
