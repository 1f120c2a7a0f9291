#include <pybind11/pybind11.h>
namespace py = pybind11;
static int destroyed = 0;
struct G { ~G() { destroyed += 1; } };
PYBIND11_MODULE(order, m) {
  py::class_<G, std::shared_ptr<G>>(m, "_G").def(py::init<>());
  m.def("destroyed", []() { return destroyed; });
}
