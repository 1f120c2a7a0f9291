"""Fix (3) vs. torch's real destructor order. A pybind11 class stands in for torch._C._CUDAGraph:
its C++ destructor (torch: ~CUDAGraph -> reset() -> releasePool, use_count-1) runs BEFORE the
Python weakref callbacks (GraphPool._gone). So GraphPool.capturing() holding _lock does not stop
torch's use_count reaching 0 inside the window; only `live` is held back.
Run: PYTHONPATH=/tmp/review2_scratch/pyb:/work/wip-pool python3 window_pybind.py"""
import threading, time
import order
from graphify.backends.graph_pool import GraphPool

class CUDAGraph(order._G):          # like torch.cuda.CUDAGraph(torch._C._CUDAGraph), incl. its __del__
    def __del__(self):
        pass

captures = 0                          # graphs torch counted into the id (capture_begin)
def use_count():                      # torch's per-id count: captures minus C++ destructors run
    return captures - order.destroyed()

ids = iter(range(100))
pool = GraphPool(lambda: next(ids))
old = CUDAGraph(); pool.for_capture(); captures += 1; pool.holds(old)

def other_thread_drops_last_graph():
    global old
    del old                            # e.g. _drop/_purge/superseded in another thread

with pool.capturing() as pid:         # torch_cuda.py:107; live == 1 -> keeps id 0
    t = threading.Thread(target=other_thread_drops_last_graph); t.start()
    time.sleep(0.3)                    # usage(), clear_cublas_workspaces() ... in the real window
    print(f"id={pid} GraphPool.live={pool.live} torch use_count={use_count()} "
          f"-> capture_begin({pid}) {'ASSERTS (use_count > 0)' if use_count() == 0 else 'ok'}")
    new = CUDAGraph(); captures += 1; pool.holds(new)
t.join()
print("after: live =", pool.live)
