// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// The library's status as the Python exception its code calls for, shared by the host and the CUDA binding: one
// table (pybind11 maps std::invalid_argument to ValueError, std::overflow_error to OverflowError, std::runtime_error to
// RuntimeError; memory_error becomes MemoryError through the translator each module registers). The message names
// the argument and ends with the code.
#pragma once

#include <pybind11/pybind11.h>

#include <contrastive/status.hpp>

#include <exception>
#include <stdexcept>
#include <string>

namespace contrastive_torch
{
struct memory_error : std::runtime_error
{
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void raise(const contrastive::status& st)
{
  namespace cl = contrastive;
  const std::string m = std::string("contrastive: ") + st.message() + " [" + cl::to_string(st.code()) + "]";
  switch (st.code())
  {
  case cl::errc::size_overflow:
    throw std::overflow_error(m);
  case cl::errc::resource_exhausted:
    throw memory_error(m);
  case cl::errc::cuda_error:
  case cl::errc::communication_error:
    throw std::runtime_error(m);
  default: // the input or a setting is outside its domain
    throw std::invalid_argument(m);
  }
}

/// memory_error as Python's MemoryError (call once in each module's init).
inline void register_errors()
{
  pybind11::register_exception_translator(
      [](std::exception_ptr p)
      {
        try
        {
          if (p)
          {
            std::rethrow_exception(p);
          }
        }
        catch (const memory_error& e)
        {
          PyErr_SetString(PyExc_MemoryError, e.what());
        }
      });
}
} // namespace contrastive_torch
