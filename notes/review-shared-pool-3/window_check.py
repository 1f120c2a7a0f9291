"""Why a capture's window (capture_begin..capture_end) holds the shared call lock: a replay on
another thread while torch's generators are in capture mode (not run: no GPU was free). Runs the scenario with the
window as the branch has it, then with a window that takes no lock. PYTHONPATH=<tree>."""
import contextlib, threading, time, torch
from graphify import graphify as gfy
from graphify.call import shared_calls

def scenario(label):
    inside, go, errors = threading.Event(), threading.Event(), []
    def f(x):
        if x.shape[1] == 2048 and torch.cuda.is_current_stream_capturing() and go.is_set():
            inside.set()
            time.sleep(0.5)  # calls on the other thread come meanwhile
        return torch.relu(x.repeat(1, 8) - 0.5).sum(-1) + 0 * torch.rand(x.shape[0], device=x.device)
    g = gfy(f)
    a, b = torch.rand(256, 4096, device="cuda"), torch.rand(256, 2048, device="cuda")
    for _ in range(3):
        g(a)
    g(b)
    torch.cuda.synchronize()
    go.set()
    t = threading.Thread(target=lambda: g(b)); t.start()
    inside.wait(10)
    s = torch.cuda.Stream()
    try:
        with torch.cuda.stream(s):
            for _ in range(5):
                g(a)
        torch.cuda.synchronize()
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    t.join()
    print(f"{label}: calls during the capture window -> {errors or 'fine'}")

scenario("window holds the call lock")
shared_calls.SharedCalls.window = lambda self: contextlib.nullcontext()
scenario("window takes no lock")
