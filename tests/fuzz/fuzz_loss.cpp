// Fuzz target over the host API: shapes, values, labels, policy settings and call sequences come from the input
// bytes. It asserts what the README promises: every call returns a status; a refused call writes nothing and changes
// no state; an accepted step either is diagnosed non-finite or has a finite loss and finite gradients. Under
// AddressSanitizer/UndefinedBehaviorSanitizer any memory error is a crash, so "a status or a finite result, never a
// sanitizer report" is checked on every input.
//
// Built two ways: with clang's libFuzzer (-fsanitize=fuzzer; CMake option CONTRASTIVE_FUZZ), and as a seeded random
// driver (fuzz_driver.cpp) that any compiler builds and ctest runs.

#include <contrastive/contrastive.hpp>
#include <contrastive/distributed/loss.hpp>
#include <contrastive/policy/range_guard.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace cl = contrastive;

namespace
{
/// Reads bounded integers and floats from the input, zeros once it is exhausted.
class byte_reader
{
public:
  byte_reader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  std::uint32_t u32()
  {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i)
    {
      v = (v << 8) | byte();
    }
    return v;
  }
  std::uint8_t byte()
  {
    return pos_ < size_ ? data_[pos_++] : 0;
  }
  std::size_t below(std::size_t n)
  {
    return n == 0 ? 0 : byte() % n;
  }
  /// Whether `value` may return the edges of float (NaN, inf, huge, tiny); off for most inputs so that most
  /// problems are accepted and their results checked.
  void allow_edges(bool on)
  {
    edges_ = on;
  }

  /// Ordinary values in [-1, 1], and with edges allowed, rarely the edges of float.
  float value()
  {
    const std::uint8_t kind = byte();
    if (!edges_ || kind < 250)
    {
      return (static_cast<float>(u32() % 20001u) - 10000.0f) / 10000.0f;
    }
    switch (kind % 8)
    {
    case 0:
      return std::numeric_limits<float>::quiet_NaN();
    case 1:
      return std::numeric_limits<float>::infinity();
    case 2:
      return -std::numeric_limits<float>::infinity();
    case 3:
      return 6.0e4f;
    case 4:
      return 1e-30f;
    case 5:
      return 3.0e38f;
    default:
    {
      const std::uint32_t bits = u32();
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    }
  }
  /// A positive setting, sometimes out of domain.
  float setting(float typical)
  {
    const std::uint8_t kind = byte();
    if (kind < 220)
    {
      return typical * std::ldexp(1.0f, static_cast<int>(kind % 16) - 8);
    }
    return value();
  }

private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
  bool edges_ = false;
};

void require(bool ok, const char* what, const cl::status& st = {})
{
  if (!ok)
  {
    std::fprintf(stderr, "fuzz_loss: violated: %s (status: %s)\n", what, st.message().c_str());
    std::abort();
  }
}

template <class T>
bool all_sentinel(const std::vector<T>& v)
{
  for (const T& x : v)
  {
    if (cl::element_traits<T>::to_float(x) != 7.0f)
    {
      return false;
    }
  }
  return true;
}

template <class T>
bool all_finite(const std::vector<T>& v)
{
  for (const T& x : v)
  {
    if (!cl::element_traits<T>::is_finite(x))
    {
      return false;
    }
  }
  return true;
}

/// A problem read from the input: shapes below the given bounds, objective, optional labels (sometimes -1 or >= n_k),
/// values from the input (non-finite and extreme ones included). Each buffer has one element past its end.
template <class T>
struct fuzz_problem
{
  std::size_t n_q, n_k, dim;
  cl::objective obj;
  bool with_labels;
  std::vector<T> q, k;
  std::vector<std::int32_t> labels;

  fuzz_problem(byte_reader& in, std::size_t max_q, std::size_t max_k, std::size_t max_dim)
      : n_q(in.below(max_q)), n_k(in.below(max_k)), dim(in.below(max_dim)),
        obj(in.byte() % 2 == 0 ? cl::objective::symmetric : cl::objective::info_nce), with_labels(in.byte() % 3 == 0),
        q(n_q * dim + 1), k(n_k * dim + 1), labels(n_q + 1)
  {
    for (auto& x : q)
    {
      x = cl::element_traits<T>::from_float(in.value());
    }
    for (auto& x : k)
    {
      x = cl::element_traits<T>::from_float(in.value());
    }
    for (auto& l : labels)
    {
      l = static_cast<std::int32_t>(in.below(n_k + 3)) - 1;
    }
  }

  cl::problem<T> problem() const noexcept
  {
    return {q.data(), k.data(), n_q, n_k, dim, with_labels ? labels.data() : nullptr, obj};
  }
};

template <class T, class Temperature, class Scaler, class Algorithm>
void run(byte_reader& in, const Temperature& temp, const Scaler& scal)
{
  using L = cl::loss<T, Temperature, Scaler, Algorithm>;
  const fuzz_problem<T> in_p(in, 34, 40, 40);
  const std::size_t n_q = in_p.n_q, n_k = in_p.n_k, dim = in_p.dim;
  const unsigned threads = 1 + static_cast<unsigned>(in.below(3));
  L loss(temp, scal, threads);
  if constexpr (std::is_same_v<Algorithm, cl::algorithm::chunked>)
  {
    // 0: the default budget (usually one chunk); otherwise 1 to 3 row blocks per chunk, or a tiny byte budget.
    const std::size_t pick = in.byte() % 5;
    const cl::chunk_options o{pick < 4 ? pick * 64 : 0, pick < 4 ? 0 : std::size_t(1)};
    if (!loss.set_chunk(o).ok())
    {
      std::abort();
    }
  }
  const T seven = cl::element_traits<T>::from_float(7.0f);
  const cl::problem<T> p = in_p.problem();

  const int calls = 1 + static_cast<int>(in.below(4));
  for (int c = 0; c < calls; ++c)
  {
    std::vector<T> dq(n_q * dim + 1, seven), dk(n_k * dim + 1, seven);
    const typename L::checkpoint before = loss.save();
    cl::step_record rec;
    switch (in.byte() % 3)
    {
    case 0:
    {
      const cl::status st = loss.step(p, dq.data(), dk.data(), rec);
      if (!st.ok())
      {
        const typename L::checkpoint after = loss.save();
        require(std::memcmp(&before, &after, sizeof before) == 0, "a refused step changed the state", st);
        require(all_sentinel(dq) && all_sentinel(dk), "a refused step wrote an output", st);
        require(!st.argument().empty() && !st.message().empty(), "an error without argument or message");
      }
      else
      {
        require(loss.steps() == before.step + 1, "an accepted step did not count");
        if (rec.first_nonfinite == cl::nonfinite_site::none)
        {
          require(std::isfinite(rec.loss), "a finite step with a non-finite loss");
          dq.pop_back();
          dk.pop_back();
          require(all_finite(dq) && all_finite(dk), "a finite step with non-finite gradients");
        }
        else
        {
          require(rec.skipped, "a non-finite step that was not skipped");
        }
      }
      break;
    }
    case 1:
    {
      float value = 0.0f, g = 0.0f;
      std::vector<float> row(n_q + 1), col(n_k + 1);
      if (loss.forward(p, value, row.data(), col.data()).ok())
      {
        require(loss.backward(dq.data(), dk.data(), g).ok(), "backward after a successful forward failed");
      }
      else
      {
        // Whether an earlier forward is still ready or not, backward must not crash.
        (void)loss.backward(dq.data(), dk.data(), g);
      }
      const typename L::checkpoint after = loss.save();
      require(std::memcmp(&before, &after, sizeof before) == 0, "forward/backward changed policy state");
      break;
    }
    default:
    {
      const cl::status st = loss.forward_backward(p, dq.data(), dk.data(), rec);
      if (st.ok())
      {
        float extra[3] = {in.value(), in.value(), in.value()};
        require(loss.unscale_and_check(extra, 3, rec).ok(), "unscale_and_check refused a pending step");
        require(loss.finish_step(rec).ok(), "finish_step refused a pending step");
      }
      else
      {
        require(loss.finish_step(rec).code() == cl::errc::invalid_argument, "finish_step without a step");
      }
      break;
    }
    }
  }
}

template <class T, class Algorithm>
void with_policies(byte_reader& in)
{
  const float tau = in.setting(0.07f);
  const float lr = in.setting(1e-3f);
  const cl::optimizer opt =
      in.byte() % 2 == 0 ? cl::optimizer::adam(lr, 0.9f, in.byte() % 2 ? 0.999f : in.setting(0.5f), in.setting(1e-8f))
                         : cl::optimizer::sgd(lr, in.byte() % 2 ? 0.0f : in.setting(0.5f));
  cl::scaler::dynamic dyn = cl::scaler::dynamic::torch();
  dyn.scale = in.setting(65536.0f);
  dyn.growth_interval = static_cast<std::int32_t>(in.below(5));
  dyn.backoff_interval = 1 + static_cast<std::int32_t>(in.below(3));
  if (in.byte() % 4 == 0)
  {
    dyn.growth_factor = in.setting(2.0f);
    dyn.backoff_factor = in.setting(0.5f);
  }
  const cl::scaler::static_scale fixed_scale(in.setting(1.0f));
  switch (in.byte() % 6)
  {
  case 0:
    run<T, cl::temperature::fixed, cl::scaler::static_scale, Algorithm>(in, cl::temperature::fixed(tau), fixed_scale);
    break;
  case 1:
    run<T, cl::temperature::learnable, cl::scaler::dynamic, Algorithm>(in, cl::temperature::learnable(tau, opt), dyn);
    break;
  case 2:
    run<T, cl::temperature::clamped, cl::scaler::dynamic, Algorithm>(
        in, cl::temperature::clamped(tau, in.setting(0.01f), in.setting(1.0f), opt), dyn);
    break;
  case 3:
    run<T, cl::temperature::freeze_then_learn, cl::scaler::dynamic, Algorithm>(
        in, cl::temperature::freeze_then_learn(tau, static_cast<std::int64_t>(in.below(3)), opt), dyn);
    break;
  case 4:
    run<T, cl::temperature::schedule, cl::scaler::static_scale, Algorithm>(
        in, cl::temperature::schedule(cl::temperature::schedule_kind::cosine, tau, in.setting(0.01f), 3), fixed_scale);
    break;
  default:
    run<T, cl::temperature::range_guard, cl::scaler::dynamic, Algorithm>(
        in, cl::temperature::range_guard(tau, opt, in.setting(16.0f)), dyn);
    break;
  }
}
} // namespace

/// The distributed loss over one process (comm::local): the same contract (a refused step writes and changes
/// nothing; an accepted finite step is finite), and an accepted step equals the one-process loss's.
template <class T, class Algorithm>
static void run_distributed(byte_reader& in)
{
  using dist_t = cl::distributed::
      loss<T, cl::temperature::learnable, cl::scaler::dynamic, Algorithm, cl::distributed::comm::local>;
  using one_t = cl::loss<T, cl::temperature::learnable, cl::scaler::dynamic, Algorithm>;
  const fuzz_problem<T> in_p(in, 30, 36, 24);
  const std::size_t n_q = in_p.n_q, n_k = in_p.n_k, dim = in_p.dim;
  const auto temp = cl::temperature::learnable(in.setting(0.07f));
  auto scal = cl::scaler::dynamic::torch();
  scal.scale = in.setting(1024.0f);
  dist_t dist(cl::distributed::comm::local{}, temp, scal, 1 + static_cast<unsigned>(in.below(2)));
  one_t one(temp, scal, 1);
  const T seven = cl::element_traits<T>::from_float(7.0f);
  const cl::problem<T> p = in_p.problem();
  std::vector<T> dq(n_q * dim + 1, seven), dk(n_k * dim + 1, seven), dq1(n_q * dim + 1), dk1(n_k * dim + 1);
  const typename dist_t::checkpoint before = dist.save();
  cl::step_record rec, rec1;
  const cl::status st = dist.step(p, dq.data(), dk.data(), rec);
  const cl::status st1 = one.step(p, dq1.data(), dk1.data(), rec1);
  if (!st.ok())
  {
    const typename dist_t::checkpoint after = dist.save();
    require(std::memcmp(&before, &after, sizeof before) == 0, "distributed: a refused step changed the state", st);
    require(all_sentinel(dq) && all_sentinel(dk), "distributed: a refused step wrote an output", st);
    require(!st1.ok(), "distributed refused what one process accepted", st);
    return;
  }
  require(st1.ok(), "distributed accepted what one process refused", st1);
  require(rec.first_nonfinite == rec1.first_nonfinite, "distributed and one process diagnose differently");
  if (rec.first_nonfinite == cl::nonfinite_site::none)
  {
    require(std::isfinite(rec.loss), "distributed: a finite step with a non-finite loss");
    require(std::fabs(rec.loss - rec1.loss) <= 1e-4f * (1.0f + std::fabs(rec1.loss)), "distributed loss differs");
  }
  require(dist.tau() == one.tau() || rec.first_nonfinite != cl::nonfinite_site::none || !std::isfinite(one.tau()),
          "distributed and one process moved tau differently");
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size)
{
  byte_reader in(data, size);
  in.allow_edges(in.byte() % 4 == 0);
  switch (in.byte() % 10)
  {
  case 8:
    run_distributed<float, cl::algorithm::fused>(in);
    break;
  case 9:
    run_distributed<__half, cl::algorithm::chunked>(in);
    break;
  case 6:
    with_policies<float, cl::algorithm::chunked>(in);
    break;
  case 7:
    with_policies<__half, cl::algorithm::chunked>(in);
    break;
  case 0:
    with_policies<float, cl::algorithm::fused>(in);
    break;
  case 1:
    with_policies<float, cl::algorithm::materialized>(in);
    break;
  case 2:
    with_policies<__half, cl::algorithm::fused>(in);
    break;
  case 3:
    with_policies<__half, cl::algorithm::materialized>(in);
    break;
  case 4:
    with_policies<__nv_bfloat16, cl::algorithm::fused>(in);
    break;
  default:
    with_policies<__nv_bfloat16, cl::algorithm::materialized>(in);
    break;
  }
  return 0;
}
