"""llama.cpp's llama-server as the peer of scripts/bench-llama-server.py and scripts/fidelity-llama.py: start it,
wait until it answers, post JSON to it, stop it. Standard library only."""
import contextlib
import json
import subprocess
import sys
import time
import urllib.request


def post(url, body, timeout=7200):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def serve(server, model, threads, slots, ctx, port, extra=()):
    """Runs llama-server on 127.0.0.1:`port` with `slots` parallel slots sharing a context of `ctx` tokens; yields
    its base URL once /health answers, and stops it afterwards."""
    cmd = [server, "-m", model, "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx),
           "--port", str(port), "--host", "127.0.0.1", "--no-webui", "--log-disable", *extra]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if process.poll() is not None or time.time() > deadline:
                sys.exit(f"llama-server did not start: {' '.join(cmd)}")
            time.sleep(0.5)
        yield base
    finally:
        process.terminate()
        process.wait()
