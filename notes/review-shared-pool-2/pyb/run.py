import weakref, order
class G(order._G):          # as torch.cuda.CUDAGraph(torch._C._CUDAGraph), with a __del__ like it
    def __del__(self): pass
seen = []
g = G()
weakref.finalize(g, lambda: seen.append(order.destroyed()))
del g
print("C++ destructors run before the weakref.finalize callback:", seen)  # [1] -> destructor first
