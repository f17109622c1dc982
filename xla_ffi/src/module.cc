// nanobind module: the registrations() dict of XLA FFI handler capsules.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

NB_MODULE(_native, m) {
  m.doc() = "jax-mxfp4 native XLA FFI handlers";
  m.def("registrations", []() { return nb::dict(); });
}
