import threading, traceback, os
import graphify.call.shared_calls as sc
LOG = "/tmp/review2_scratch/reent/reentries.txt"
class Spy:
    def __init__(self):
        self._l = threading.RLock(); self.owner = None; self.depth = 0
    def acquire(self, *a, **k):
        me = threading.get_ident()
        if self.owner == me:
            with open(LOG, "a") as f:
                f.write("".join(traceback.format_stack(limit=14)) + "\n=====\n")
        r = self._l.acquire(*a, **k); self.owner = me; self.depth += 1; return r
    def release(self):
        self.depth -= 1
        if self.depth == 0: self.owner = None
        self._l.release()
    __enter__ = acquire
    def __exit__(self, *e): self.release()
orig = sc.SharedCalls.__init__
def init(self):
    orig(self); self.lock = Spy()
sc.SharedCalls.__init__ = init
