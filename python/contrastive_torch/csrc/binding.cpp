// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// PyTorch binding of the host library: one `Loss` object per (element type, algorithm), holding the library's
// engine between the forward and the backward of one autograd call. Errors become Python exceptions: the library's
// status as ValueError (its message names the argument), wrong dtypes as TypeError.
//
// `Loss(dtype, algorithm, threads, group)` runs over a torch.distributed process group (torch_comm.hpp): each call
// is a collective of the global batch (contrastive::core over ranks). `agree` is the Python side's own agreement:
// every rank's verdict on its checks and a few values, all-gathered, so an error found on one rank raises on all.

#include <torch/extension.h>

#include "errors.hpp"
#include "problem_of.hpp"

#if __has_include(<torch/csrc/distributed/c10d/ProcessGroup.hpp>)
#define CONTRASTIVE_TORCH_DISTRIBUTED 1
#include "torch_comm.hpp"
#else
#define CONTRASTIVE_TORCH_DISTRIBUTED 0
#endif

#include <contrastive/contrastive.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace cl = contrastive;

namespace
{
/// The library's policy-free call (contrastive::core): PyTorch owns the temperature (logit_scale, a parameter) and the
/// loss scaling (the incoming gradient, e.g. GradScaler's scale), so each call passes them as numbers; the engine's
/// buffers and the forward's statistics are kept between the forward and the backward of one autograd call.
class handle_base
{
public:
  virtual ~handle_base() = default;
  /// The loss of (q, k) at logit scale `scale` and (sigmoid) logit bias `bias` for `obj`; the positives from labels,
  /// or from group ids (int64, undefined: none).
  virtual std::vector<double> forward(const torch::Tensor& q,
                                      const torch::Tensor& k,
                                      double scale,
                                      double bias,
                                      const torch::Tensor& labels,
                                      cl::objective obj,
                                      const torch::Tensor& query_groups,
                                      const torch::Tensor& key_groups) = 0;
  /// {dq, dk, d(loss_scale loss)/d log s, d(loss_scale loss)/d b} of the last forward.
  virtual std::vector<torch::Tensor> backward(double loss_scale) = 0;
  virtual std::size_t bytes_held() const = 0;
  /// algorithm::automatic: its memory budget (0: a quarter of the available memory at each call); the algorithm the
  /// last call ran.
  virtual void set_memory_budget(std::size_t bytes) = 0;
  virtual std::string algorithm_used() const = 0;
  /// {first non-finite site of the last forward + backward ("none", "logits", ...), largest logit}.
  virtual std::pair<std::string, double> diagnosis() const = 0;
};

/// resource_exhausted: raised in Python as MemoryError (the translator below), with the library's message.
using contrastive_torch::raise;

template <class T, class Algorithm, class Comm = cl::distributed::comm::self>
class handle final : public handle_base
{
public:
  explicit handle(unsigned threads) : core_(threads) {}
  handle(Comm comm, unsigned threads) : core_(std::move(comm), threads) {}

  std::vector<double> forward(const torch::Tensor& q,
                              const torch::Tensor& k,
                              double scale,
                              double bias,
                              const torch::Tensor& labels,
                              cl::objective obj,
                              const torch::Tensor& query_groups,
                              const torch::Tensor& key_groups) override
  {
    const cl::problem<T> p = contrastive_torch::problem_of<T>(q, k, labels, obj, query_groups, key_groups);
    cl::step::forward_values f;
    const cl::status st = core_.forward(p, static_cast<float>(scale), static_cast<float>(bias), f);
    if (!st.ok())
    {
      raise(st);
    }
    q_ = q;
    k_ = k;
    labels_ = labels;
    query_groups_ = query_groups;
    key_groups_ = key_groups;
    n_q_ = p.n_q;
    n_k_ = p.n_k;
    dim_ = p.dim;
    return {static_cast<double>(f.loss), 1.0 / static_cast<double>(static_cast<float>(scale))};
  }

  std::vector<torch::Tensor> backward(double loss_scale) override
  {
    torch::Tensor dq = torch::empty({static_cast<std::int64_t>(n_q_), static_cast<std::int64_t>(dim_)}, q_.options());
    torch::Tensor dk = torch::empty({static_cast<std::int64_t>(n_k_), static_cast<std::int64_t>(dim_)}, k_.options());
    cl::step::backward_values b;
    const cl::status st = core_.backward(
        static_cast<float>(loss_scale), reinterpret_cast<T*>(dq.data_ptr()), reinterpret_cast<T*>(dk.data_ptr()), b);
    if (!st.ok())
    {
      raise(st);
    }
    q_ = k_ = labels_ = query_groups_ = key_groups_ = torch::Tensor();
    return {dq,
            dk,
            torch::tensor(static_cast<double>(b.grad_logit_scale), torch::kFloat64),
            torch::tensor(static_cast<double>(b.grad_logit_bias), torch::kFloat64)};
  }

  std::size_t bytes_held() const override
  {
    return core_.bytes_held();
  }

  void set_memory_budget(std::size_t bytes) override
  {
    if constexpr (std::is_same_v<Algorithm, cl::algorithm::automatic>)
    {
      (void)core_.set_memory_budget(bytes);
    }
    else
    {
      (void)bytes;
    }
  }
  std::string algorithm_used() const override
  {
    return core_.algorithm_used();
  }

  std::pair<std::string, double> diagnosis() const override
  {
    return {cl::to_string(core_.diagnose()), static_cast<double>(core_.last_forward().max_logit)};
  }

private:
  cl::core<T, Algorithm, cl::gemm::builtin, Comm> core_;
  // Kept alive from forward to backward (the engine reads them again).
  torch::Tensor q_, k_, labels_, query_groups_, key_groups_;
  std::size_t n_q_ = 0, n_k_ = 0, dim_ = 0;
};

/// A handle for (T, algorithm): one process, or over `comm...` (a communicator) when given.
template <class T, class... Comm>
std::unique_ptr<handle_base> make_for(const std::string& algorithm, unsigned threads, Comm... comm)
{
  std::unique_ptr<handle_base> h;
  if constexpr (sizeof...(Comm) == 0)
  {
    // One process only: ranks need one algorithm each (the Python layer resolves None to fused there).
    if (algorithm == "automatic")
    {
      return std::make_unique<handle<T, cl::algorithm::automatic>>(threads);
    }
  }
  const bool known =
      cl::algorithm::dispatch(algorithm.c_str(),
                              [&](auto tag)
                              {
                                h = std::make_unique<handle<T, decltype(tag), Comm...>>(comm..., threads);
                              });
  if (!known)
  {
    throw std::invalid_argument("contrastive: algorithm: '" + algorithm + "' is not one of " + cl::algorithm::names());
  }
  return h;
}

template <class... Comm>
std::unique_ptr<handle_base>
make_handle(const std::string& dtype, const std::string& algorithm, std::int64_t threads, Comm... comm)
{
  if (threads < 0)
  {
    throw std::invalid_argument("contrastive: threads: must be >= 0 (0 = all cores)");
  }
  const unsigned t = static_cast<unsigned>(threads);
  if (dtype == "float32")
  {
    return make_for<float>(algorithm, t, comm...);
  }
  if (dtype == "bfloat16")
  {
    return make_for<__nv_bfloat16>(algorithm, t, comm...);
  }
  if (dtype == "float16")
  {
    return make_for<__half>(algorithm, t, comm...);
  }
  throw pybind11::type_error("contrastive: dtype: " + dtype + " is not float32, bfloat16 or float16");
}

/// The Python-visible object.
class Loss
{
public:
  Loss(const std::string& dtype, const std::string& algorithm, std::int64_t threads)
      : impl_(make_handle(dtype, algorithm, threads))
  {
  }
#if CONTRASTIVE_TORCH_DISTRIBUTED
  /// Over a process group: every forward and backward is a collective of the group's ranks (the global batch).
  Loss(const std::string& dtype,
       const std::string& algorithm,
       std::int64_t threads,
       const c10::intrusive_ptr<c10d::ProcessGroup>& group)
      : comm_(std::make_unique<contrastive_torch::torch_comm>(group->getRank(), group->getSize())),
        impl_(make_handle(dtype, algorithm, threads, *comm_))
  {
  }
#endif

  std::vector<double> forward(const torch::Tensor& q,
                              const torch::Tensor& k,
                              double scale,
                              const c10::optional<torch::Tensor>& labels,
                              bool symmetric,
                              const pybind11::object& group,
                              const c10::optional<torch::Tensor>& query_groups,
                              const c10::optional<torch::Tensor>& key_groups)
  {
    const bound b(*this, group);
    return impl_->forward(q,
                          k,
                          scale,
                          0.0,
                          labels.value_or(torch::Tensor()),
                          symmetric ? cl::objective::symmetric : cl::objective::info_nce,
                          query_groups.value_or(torch::Tensor()),
                          key_groups.value_or(torch::Tensor()));
  }

  /// The sigmoid objective (SigLIP): logits scale * q k^T + bias.
  std::vector<double> forward_sigmoid(const torch::Tensor& q,
                                      const torch::Tensor& k,
                                      double scale,
                                      double bias,
                                      const c10::optional<torch::Tensor>& labels,
                                      const pybind11::object& group,
                                      const c10::optional<torch::Tensor>& query_groups,
                                      const c10::optional<torch::Tensor>& key_groups)
  {
    const bound b(*this, group);
    return impl_->forward(q,
                          k,
                          scale,
                          bias,
                          labels.value_or(torch::Tensor()),
                          cl::objective::sigmoid,
                          query_groups.value_or(torch::Tensor()),
                          key_groups.value_or(torch::Tensor()));
  }

  std::vector<torch::Tensor> backward(double loss_scale, const pybind11::object& group)
  {
    const bound b(*this, group);
    std::vector<torch::Tensor> g = impl_->backward(loss_scale);
    g.pop_back(); // the softmax objectives' d loss / d b is 0
    return g;
  }

  /// {dq, dk, d(loss_scale loss)/d log s, d(loss_scale loss)/d b} of a forward_sigmoid.
  std::vector<torch::Tensor> backward_sigmoid(double loss_scale, const pybind11::object& group)
  {
    const bound b(*this, group);
    return impl_->backward(loss_scale);
  }

  std::int64_t bytes_held() const
  {
    return static_cast<std::int64_t>(impl_->bytes_held());
  }

  /// algorithm "automatic": the budget its choice compares materialized's bytes with (0: a quarter of the memory
  /// available at each call).
  void set_memory_budget(std::int64_t bytes)
  {
    if (bytes < 0)
    {
      throw std::invalid_argument("contrastive: budget: must be >= 0 bytes (0: the default), got " +
                                  std::to_string(bytes));
    }
    impl_->set_memory_budget(static_cast<std::size_t>(bytes));
  }
  /// The algorithm the last call ran ("none" before the first).
  std::string algorithm_used() const
  {
    return impl_->algorithm_used();
  }

  std::pair<std::string, double> diagnosis() const
  {
    return impl_->diagnosis();
  }

private:
#if CONTRASTIVE_TORCH_DISTRIBUTED
  /// The process group a distributed engine's call runs over (passed with each call, never kept: see torch_comm).
  struct bound
  {
    std::optional<contrastive_torch::torch_comm::scope> scope;
    bound(const Loss& loss, const pybind11::object& group)
    {
      if (!loss.comm_)
      {
        return;
      }
      if (group.is_none())
      {
        throw std::invalid_argument("contrastive: group: this engine runs over a process group; pass it");
      }
      // Cast with the GIL held (the caller holds it for this); the Python object keeps the group alive for the call.
      c10::intrusive_ptr<c10d::ProcessGroup> g;
      {
        const pybind11::gil_scoped_acquire gil;
        g = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
      }
      scope.emplace(*loss.comm_, *g);
    }
  };
  std::unique_ptr<contrastive_torch::torch_comm> comm_;
#else
  struct bound
  {
    bound(const Loss&, const pybind11::object&) {}
  };
#endif
  std::unique_ptr<handle_base> impl_;
};

#if CONTRASTIVE_TORCH_DISTRIBUTED
/// The most values a rank says in `agree` (the Python side's `_AGREED_VALUES`).
constexpr int agree_values = 12;

/// What each rank says in `agree`: its verdict (0: fine, else the Python exception kind) and up to 12 values.
struct agree_msg
{
  std::int32_t kind;
  std::int32_t n;
  double values[agree_values];
};

/// The Python side's agreement (one all-gather; one broadcast more when a rank failed): returns (the first rank whose
/// kind is not 0, or -1; its kind; its message; every rank's values). Every rank gets the same answer, so every rank
/// raises the same error. A failing collective raises RuntimeError (communication_error) on the ranks it fails on.
std::tuple<int, int, std::string, std::vector<std::vector<double>>>
agree(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
      std::int64_t kind,
      const std::string& message,
      const std::vector<double>& values)
{
  const contrastive_torch::torch_comm comm(*group); // bound for this call; the caller holds the group
  agree_msg mine;
  std::memset(&mine, 0, sizeof mine);
  mine.kind = static_cast<std::int32_t>(kind);
  mine.n = static_cast<std::int32_t>(std::min<std::size_t>(values.size(), agree_values));
  std::copy_n(values.begin(), mine.n, mine.values);
  std::vector<agree_msg> all(static_cast<std::size_t>(comm.size()));
  if (const cl::status st = comm.allgather(&mine, sizeof mine, all.data()); !st.ok())
  {
    raise(st);
  }
  std::vector<std::vector<double>> got;
  for (const agree_msg& m : all)
  {
    got.emplace_back(m.values, m.values + std::max(0, std::min(m.n, agree_values)));
  }
  for (int r = 0; r < comm.size(); ++r)
  {
    const agree_msg& m = all[static_cast<std::size_t>(r)];
    if (m.kind == 0)
    {
      continue;
    }
    char text[1024] = {};
    if (r == comm.rank())
    {
      std::strncpy(text, message.c_str(), sizeof text - 1);
    }
    if (const cl::status st = comm.broadcast(text, sizeof text, r); !st.ok())
    {
      raise(st);
    }
    return {r, m.kind, std::string(text), got};
  }
  return {-1, 0, std::string(), got};
}
#endif

/// One step of the library's `temperature::range_guard` on explicit state, for tests/test_temperature.py (Python's
/// RangeGuard is checked against it bit for bit). `theta_prev` is theta after the previous step, `theta_opt` the
/// optimiser's result for this one (used on finite steps only, as the library's learnable `advance` does: NaN keeps
/// theta, else it is kept within the domain and under the ceiling); then the policy's own `observe`. Returns {theta,
/// ceiling, events, first moment}.
std::tuple<double, double, std::int64_t, double> range_guard_observe(const std::string& dtype,
                                                                     double headroom,
                                                                     double retreat,
                                                                     double scale_floor,
                                                                     double tau_max,
                                                                     double ceiling,
                                                                     std::int64_t events,
                                                                     double first_moment,
                                                                     double theta_prev,
                                                                     double theta_opt,
                                                                     bool skipped,
                                                                     std::int64_t site,
                                                                     double loss_scale,
                                                                     double next_loss_scale)
{
  cl::temperature::range_guard g(0.07f,
                                 cl::optimizer::adam(1e-3f),
                                 static_cast<float>(headroom),
                                 static_cast<float>(retreat),
                                 static_cast<float>(scale_floor),
                                 static_cast<float>(tau_max));
  if (site < 0 || site > static_cast<std::int64_t>(cl::nonfinite_site::grad_logit_bias))
  {
    throw std::invalid_argument("site must be a nonfinite_site code");
  }
  g.ceiling = static_cast<float>(ceiling);
  g.events = static_cast<std::int32_t>(events);
  g.opt_state.m = first_moment;
  g.theta = static_cast<float>(theta_prev);
  if (!skipped)
  {
    const float next = static_cast<float>(theta_opt);
    g.theta = g.clamp(next != next ? g.theta : cl::temperature::clamp_theta(next));
  }
  float max_finite = 0.0f;
  if (dtype == "float16")
  {
    max_finite = cl::element_traits<__half>::max_finite();
  }
  else if (dtype == "bfloat16")
  {
    max_finite = cl::element_traits<__nv_bfloat16>::max_finite();
  }
  else if (dtype == "float32")
  {
    max_finite = cl::element_traits<float>::max_finite();
  }
  else
  {
    throw std::invalid_argument("dtype must be float16, bfloat16 or float32, got " + dtype);
  }
  if (const char* why = g.validate(); why[0] != '\0')
  {
    throw std::invalid_argument(std::string("range_guard: ") + why);
  }
  cl::step_record rec{};
  rec.skipped = skipped;
  rec.first_nonfinite = static_cast<cl::nonfinite_site>(site);
  rec.loss_scale = static_cast<float>(loss_scale);
  rec.next_loss_scale = static_cast<float>(next_loss_scale);
  g.observe(rec, max_finite);
  return {g.theta, g.ceiling, g.events, g.opt_state.m};
}
} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
  m.doc() = "contrastive: temperature-scaled contrastive loss (host engine)";
  contrastive_torch::register_errors();
  pybind11::class_<Loss>(m, "Loss")
      .def(pybind11::init<const std::string&, const std::string&, std::int64_t>(),
           pybind11::arg("dtype"),
           pybind11::arg("algorithm"),
           pybind11::arg("threads") = 0)
      .def("forward",
           &Loss::forward,
           pybind11::arg("q"),
           pybind11::arg("k"),
           pybind11::arg("scale"),
           pybind11::arg("labels"),
           pybind11::arg("symmetric"),
           pybind11::arg("group") = pybind11::none(),
           pybind11::arg("query_groups") = pybind11::none(),
           pybind11::arg("key_groups") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("backward",
           &Loss::backward,
           pybind11::arg("loss_scale"),
           pybind11::arg("group") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_sigmoid",
           &Loss::forward_sigmoid,
           pybind11::arg("q"),
           pybind11::arg("k"),
           pybind11::arg("scale"),
           pybind11::arg("bias"),
           pybind11::arg("labels"),
           pybind11::arg("group") = pybind11::none(),
           pybind11::arg("query_groups") = pybind11::none(),
           pybind11::arg("key_groups") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("backward_sigmoid",
           &Loss::backward_sigmoid,
           pybind11::arg("loss_scale"),
           pybind11::arg("group") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("bytes_held", &Loss::bytes_held)
      .def("diagnosis", &Loss::diagnosis)
      .def("set_memory_budget", &Loss::set_memory_budget, pybind11::arg("bytes"))
      .def("algorithm_used", &Loss::algorithm_used)
#if CONTRASTIVE_TORCH_DISTRIBUTED
      .def(pybind11::init<const std::string&,
                          const std::string&,
                          std::int64_t,
                          const c10::intrusive_ptr<c10d::ProcessGroup>&>(),
           pybind11::arg("dtype"),
           pybind11::arg("algorithm"),
           pybind11::arg("threads"),
           pybind11::arg("group"))
#endif
      ;
  m.def("range_guard_observe", &range_guard_observe);
  m.def("host_kernels",
        []
        {
          namespace h = contrastive::host;
          pybind11::dict d;
          d["float"] = h::kernel_isa;
          d["bfloat16"] = h::bf16_kernel();
          d["amx"] = h::amx::describe(h::amx::status());
          return d;
        });
  m.attr("HAS_DISTRIBUTED") = static_cast<bool>(CONTRASTIVE_TORCH_DISTRIBUTED);
#if CONTRASTIVE_TORCH_DISTRIBUTED
  m.def("agree",
        &agree,
        pybind11::arg("group"),
        pybind11::arg("kind"),
        pybind11::arg("message"),
        pybind11::arg("values"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
#endif
}
