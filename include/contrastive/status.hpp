// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Error reporting for the host API: a status the caller tests, with a message naming the offending argument.
/// The library never throws for bad input, never aborts and never prints.

#include <cstdio>
#include <string>
#include <utility>

namespace contrastive
{
/// Class of a host call's failure (`status::code()`); success (0) when the call succeeded.
enum class errc
{
  success = 0,
  null_pointer,        ///< a required pointer is null
  empty_input,         ///< a size is zero
  shape_mismatch,      ///< sizes that must agree do not
  label_out_of_range,  ///< a positive-key index is outside [0, n_k)
  non_finite_input,    ///< an input holds NaN or +-inf
  invalid_temperature, ///< tau <= 0, non-finite, or bounds that are empty
  invalid_scaler,      ///< a loss-scaler setting is out of its domain
  invalid_argument,    ///< any other argument outside its domain
  workspace_too_small, ///< the caller's workspace is smaller than required
  cuda_error,          ///< a CUDA runtime or cuBLAS call failed (status::native() has its own code)
  size_overflow,       ///< a product of sizes (elements or bytes of a buffer) does not fit in size_t
  resource_exhausted,  ///< memory (the message gives the bytes asked for) or threads could not be had
  communication_error, ///< a collective of the distributed loss failed (MPI's or NCCL's message and code attached)
};

/// The library below a failure, whose own code a status carries (`status::native()`).
enum class native_api : int
{
  none = 0,
  cuda,   ///< the CUDA runtime: a cudaError_t
  cublas, ///< cuBLAS: a cublasStatus_t
  nccl,   ///< NCCL: an ncclResult_t
  mpi,    ///< MPI: an MPI error code
};

/// A failure's code in the library that reported it (api none: the failure is the library's own).
struct native_error
{
  native_api api = native_api::none; ///< the library that reported the failure (none: this library's own)
  int code = 0;                      ///< that library's own code (cudaError_t, cublasStatus_t, ...); 0 for none
};

/// Short name of a native library, as its enumerator is spelled; "unknown" for a value outside the enumeration.
inline const char* to_string(native_api a) noexcept
{
  switch (a)
  {
  case native_api::none:
    return "none";
  case native_api::cuda:
    return "cuda";
  case native_api::cublas:
    return "cublas";
  case native_api::nccl:
    return "nccl";
  case native_api::mpi:
    return "mpi";
  }
  return "unknown";
}

/// Short name of an error code.
inline const char* to_string(errc e) noexcept
{
  switch (e)
  {
  case errc::success:
    return "success";
  case errc::null_pointer:
    return "null_pointer";
  case errc::empty_input:
    return "empty_input";
  case errc::shape_mismatch:
    return "shape_mismatch";
  case errc::label_out_of_range:
    return "label_out_of_range";
  case errc::non_finite_input:
    return "non_finite_input";
  case errc::invalid_temperature:
    return "invalid_temperature";
  case errc::invalid_scaler:
    return "invalid_scaler";
  case errc::invalid_argument:
    return "invalid_argument";
  case errc::workspace_too_small:
    return "workspace_too_small";
  case errc::cuda_error:
    return "cuda_error";
  case errc::size_overflow:
    return "size_overflow";
  case errc::resource_exhausted:
    return "resource_exhausted";
  case errc::communication_error:
    return "communication_error";
  }
  return "unknown";
}

/// Result of a host call. `ok()` is true on success; otherwise `code()` classifies the error, `argument()` names the
/// argument at fault (or the call that failed) and `message()` says what was wrong with it; a failure of CUDA,
/// cuBLAS, NCCL or MPI also carries that library's own code (`native()`).
class [[nodiscard]] status
{
public:
  status() = default;
  /// A failure: its class, the argument at fault (or the call that failed), what was wrong with it, and the code of
  /// the library below when that library failed.
  status(errc code, std::string argument, std::string message, native_error native = {})
      : code_(code), argument_(std::move(argument)), message_(std::move(message)), native_(native)
  {
  }

  /// True when the call succeeded (`code()` is errc::success).
  bool ok() const noexcept
  {
    return code_ == errc::success;
  }
  /// The same as `ok()`.
  explicit operator bool() const noexcept
  {
    return ok();
  }
  /// Class of the failure; errc::success on success.
  errc code() const noexcept
  {
    return code_;
  }
  /// Name of the argument at fault, or of the call that failed; empty on success.
  const std::string& argument() const noexcept
  {
    return argument_;
  }
  /// "argument: message", or "success".
  std::string message() const
  {
    return ok() ? std::string("success") : argument_ + ": " + message_;
  }
  /// The message without the argument's name (for a caller that wraps this status in its own).
  const std::string& reason() const noexcept
  {
    return message_;
  }
  /// The code of the library below that failed (api none for the library's own checks).
  native_error native() const noexcept
  {
    return native_;
  }

private:
  errc code_ = errc::success;
  std::string argument_;
  std::string message_;
  native_error native_{};
};

namespace detail
{
/// A number as a message shows it: every digit a float has (%.9g), so that 1e-07 is not printed as 0.000000.
inline std::string number_text(double v)
{
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}
} // namespace detail

} // namespace contrastive

/// Returns early from the enclosing function when `expr` yields a failed status.
#define CONTRASTIVE_RETURN_IF_ERROR(expr)                                                                              \
  do                                                                                                                   \
  {                                                                                                                    \
    ::contrastive::status contrastive_status_ = (expr);                                                                \
    if (!contrastive_status_.ok())                                                                                     \
      return contrastive_status_;                                                                                      \
  } while (0)
