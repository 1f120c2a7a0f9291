"""Where graphs are captured: all of it, in one package.

- `prepare`: one call of the function made ready to capture (`Prepared`): the call bound to
  argument slots, each argument's spec, the eager twin, the backend.
- `session`: `CaptureSession`, what the captures of one table share; `capture_key` is one
  graph's step, `capture` a batch of keys.
- `capturers`: how each runtime mode captures a key, and how little each key warms up.
- `outputs`: which outputs follow the tokens or the requests.
- `context`: the garbage collector held still, the device made current.
- `errors`: what a failed capture raises.
- `ahead`: `capture()` ahead of time, every planned key (with tensor-parallel agreement).
- `call_capture`: `CallCapture`, a session held open for one first-use call structure,
  capturing one key at a time for the call that needs it (`graphify.first_use.first_use` decides).
- `function_reads`: `FunctionReads`, what the function reaches, walked once for the
  sessions of one callable, and its per-call check.
 The backends (`graphify.backends`, their protocol in `backends/_base.py`)
record and replay; this package decides what is captured, when and how.
"""

from graphify.capture.ahead import capture_ahead
from graphify.capture.call_capture import CallCapture
from graphify.capture.context import freeze_gc
from graphify.capture.function_reads import FunctionReads
from graphify.capture.prepare import Prepared, prepare
from graphify.capture.session import CaptureSession

__all__ = ["CallCapture", "CaptureSession", "FunctionReads", "Prepared", "capture_ahead", "freeze_gc", "prepare"]
