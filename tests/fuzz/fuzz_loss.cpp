// Fuzz target over the host API: shapes, values, labels, policy settings and call sequences come from the input
// bytes. It asserts what the README promises: every call returns a status; a refused call writes nothing and changes
// no state; an accepted step either is diagnosed non-finite or has a finite loss and finite gradients; save() is
// byte-deterministic (policies built in differently garbaged memory save equal bytes); a policy accepted once stays
// in its domain whatever steps follow (settings, counters and taus are drawn near the domain's edges too). Under
// AddressSanitizer/UndefinedBehaviorSanitizer any memory error is a crash, so "a status or a finite result, never a
// sanitizer report" is checked on every input.
//
// Built two ways: with clang's libFuzzer (-fsanitize=fuzzer; CMake option CONTRASTIVE_FUZZ), and as a seeded random
// driver (fuzz_driver.cpp) that any compiler builds and ctest runs.

#include <contrastive/contrastive.hpp>
#include <contrastive/core.hpp>
#include <contrastive/distributed/loss.hpp>
#include <contrastive/policy/range_guard.hpp>

#include "../thread_comm.hpp"

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
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
  /// A tau at or near an edge of the temperature domain (just inside, on, or just outside it), the values that mean
  /// "no bound" (0, inf), or an ordinary setting.
  float edge_tau();

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

bool valid(const char* why)
{
  return why[0] == '\0';
}

/// The smallest (upper = false) or largest float tau that `valid_tau` accepts: the domain's edges as the code sees
/// them.
float domain_edge(bool upper)
{
  const float limit = cl::temperature::theta_limit;
  float t = upper ? std::exp(limit) * 1.01f : std::exp(-limit) * 0.99f;
  while (!cl::temperature::valid_tau(t))
  {
    t = std::nextafter(t, 1.0f);
  }
  return t;
}

float byte_reader::edge_tau()
{
  static const float lo = domain_edge(false), hi = domain_edge(true);
  const float inf = std::numeric_limits<float>::infinity();
  switch (byte() % 12)
  {
  case 0:
    return lo;
  case 1:
    return hi;
  case 2:
    return std::nextafter(lo, 0.0f);
  case 3:
    return std::nextafter(hi, inf);
  case 4:
    return lo * (1.0f + static_cast<float>(byte()) / 16.0f);
  case 5:
    return hi / (1.0f + static_cast<float>(byte()) / 16.0f);
  case 6:
    return 0.0f;
  case 7:
    return inf;
  case 8:
    return byte() % 2 ? 1e-38f : 1e-36f;
  case 9:
    return byte() % 2 ? 1e36f : 1e37f;
  default:
    return setting(0.07f);
  }
}

/// A copy of `make()` built in memory filled with `garbage`, so any byte its constructor leaves alone holds it.
template <class P, class Make>
const P& build_in(unsigned char* buffer, unsigned char garbage, Make&& make)
{
  std::memset(buffer, garbage, sizeof(P));
  return *new (buffer) P(make());
}

template <class C>
bool same_bytes(const C& a, const C& b)
{
  return std::memcmp(&a, &b, sizeof(C)) == 0;
}

/// Counters (policy steps, optimiser steps, range_guard events) moved to a few steps below their maximum, so that
/// the calls that follow run them into it.
template <class P>
void near_max_counters(P& p, std::int64_t below)
{
  if constexpr (std::is_base_of_v<cl::temperature::learnable, P>)
  {
    p.steps = std::numeric_limits<std::int64_t>::max() - below;
    p.opt_state.t = std::numeric_limits<std::int64_t>::max() - below;
  }
  if constexpr (std::is_same_v<P, cl::temperature::schedule>)
  {
    p.steps = std::numeric_limits<std::int64_t>::max() - below;
  }
  if constexpr (std::is_same_v<P, cl::temperature::range_guard>)
  {
    p.events = std::numeric_limits<std::int32_t>::max() - static_cast<std::int32_t>(below);
  }
}

/// Policy trajectories without a loss (cheap, so long): the policies, as built twice in differently garbaged memory,
/// go through the same finish_step sequence (finite or not, gradients from the input, edges included; range_guard
/// observes). A policy that was accepted must stay accepted with a finite tau and scale > 0, and the two copies must
/// save equal bytes after every step.
template <class Element, class Temperature, class Scaler>
void check_trajectory(byte_reader& in, Temperature t, Scaler s, Temperature t2, Scaler s2)
{
  const bool t_ok = valid(t.validate()), s_ok = valid(s.validate());
  const int steps = static_cast<int>(in.below(64));
  for (int i = 0; i < steps; ++i)
  {
    cl::step_record rec{};
    rec.pending = true;
    rec.loss_scale = s.loss_scale();
    rec.grad_logit_scale = in.value();
    if (!std::isfinite(rec.grad_logit_scale))
    {
      rec.grad_logit_scale = std::signbit(rec.grad_logit_scale) ? -3.0e38f : 3.0e38f;
    }
    if (in.byte() % 3 == 0)
    {
      rec.first_nonfinite = static_cast<cl::nonfinite_site>(1 + in.below(6));
    }
    cl::step_record rec2 = rec;
    cl::detail::finish_step<Element>(t, s, rec);
    cl::detail::finish_step<Element>(t2, s2, rec2);
    require(!t_ok || valid(t.validate()), "an accepted temperature policy left its domain");
    require(!t_ok || (std::isfinite(t.tau()) && t.tau() > 0.0f && std::isfinite(t.scale()) && t.scale() > 0.0f),
            "an accepted temperature policy has a tau or scale that is not finite and > 0");
    require(!s_ok || valid(s.validate()), "an accepted scaler left the states its rule can reach");
    require(same_bytes(cl::detail::save_checkpoint(t, s, i), cl::detail::save_checkpoint(t2, s2, i)),
            "two saves of one policy state differ");
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
/// optional group ids (few distinct values, so duplicates and rows without a positive; sometimes one side only, or
/// with labels), values from the input (non-finite and extreme ones included). Each buffer has one element past its
/// end.
template <class T>
struct fuzz_problem
{
  std::size_t n_q, n_k, dim;
  cl::objective obj;
  bool with_labels;
  std::vector<T> q, k;
  std::vector<std::int32_t> labels;
  std::size_t groups_mode = 0; // 0: none, 1: both sides, 2: query ids only, 3: key ids only
  std::vector<std::int64_t> q_ids, k_ids;

  fuzz_problem(byte_reader& in, std::size_t max_q, std::size_t max_k, std::size_t max_dim)
      : n_q(in.below(max_q)), n_k(in.below(max_k)), dim(in.below(max_dim)),
        obj(static_cast<cl::objective>(in.byte() % cl::objectives::count)), with_labels(in.byte() % 3 == 0),
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
    const std::size_t g = in.byte();
    groups_mode = g < 192 ? 0 : (g < 240 ? 1 : 2 + g % 2);
    q_ids.resize(n_q + 1);
    k_ids.resize(n_k + 1);
    const std::size_t distinct = 1 + in.below(8);
    for (auto& id : q_ids)
    {
      id = static_cast<std::int64_t>(in.below(distinct)) - 3;
    }
    for (auto& id : k_ids)
    {
      id = static_cast<std::int64_t>(in.below(distinct)) - 3;
    }
  }

  cl::problem<T> problem() const noexcept
  {
    cl::problem<T> p{q.data(), k.data(), n_q, n_k, dim, with_labels ? labels.data() : nullptr, obj};
    p.query_groups = groups_mode == 1 || groups_mode == 2 ? q_ids.data() : nullptr;
    p.key_groups = groups_mode == 1 || groups_mode == 3 ? k_ids.data() : nullptr;
    return p;
  }
};

template <class T, class Temperature, class Scaler, class Algorithm>
void run(byte_reader& in, const Temperature& temp, const Scaler& scal, const Temperature& temp2, const Scaler& scal2)
{
  using L = cl::loss<T, Temperature, Scaler, Algorithm>;
  check_trajectory<T>(in, temp, scal, temp2, scal2);
  const fuzz_problem<T> in_p(in, 34, 40, 40);
  const std::size_t n_q = in_p.n_q, n_k = in_p.n_k, dim = in_p.dim;
  const unsigned threads = 1 + static_cast<unsigned>(in.below(3));
  L loss(temp, scal, threads);
  require(same_bytes(loss.save(), cl::detail::save_checkpoint(temp2, scal2, 0)),
          "saves of one state (policies built in differently garbaged memory) differ");
  if (in.byte() % 4 == 0)
  {
    // Counters a few steps below their maximum (restore accepts them; the calls below run the policies' into it).
    // The loss's own step count goes just below the largest restore accepts, so that what the (at most 4) calls
    // leave is still a checkpoint restore accepts.
    typename L::checkpoint c = loss.save();
    near_max_counters(c.temperature, static_cast<std::int64_t>(in.below(3)));
    c.step = cl::detail::max_checkpoint_step - 4;
    const cl::status st = loss.restore(c);
    require(st.ok() == (valid(temp.validate()) && valid(scal.validate())), "restore of near-maximum counters", st);
  }
  // A policy accepted now must stay accepted after any sequence of calls: no finite step may move it out of its
  // domain.
  const bool temp_ok = valid(temp.validate()), scal_ok = valid(scal.validate());
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
    require(same_bytes(before, loss.save()), "two saves of one state differ");
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
        require(!(temp_ok && st.code() == cl::errc::invalid_temperature) &&
                    !(scal_ok && st.code() == cl::errc::invalid_scaler),
                "a policy accepted before refuses a later step",
                st);
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
        if (in.byte() % 2 == 0)
        {
          // Outputs that overlap each other or an input: refused, nothing written, the forward still ready.
          std::vector<T> buf((n_q + n_k) * dim + 1, seven);
          const std::vector<T> q_before = in_p.q, k_before = in_p.k;
          T* const q_mut = const_cast<T*>(p.q);
          T* const k_mut = const_cast<T*>(p.k);
          T* a = buf.data();
          T* b = buf.data();
          switch (in.byte() % 4)
          {
          case 0:
            b = buf.data() + in.below(n_q * dim); // dk starts inside dq
            break;
          case 1:
            a = q_mut + in.below(n_q * dim); // dq inside q
            break;
          case 2:
            b = k_mut + in.below(n_k * dim); // dk inside k
            break;
          default:
            a = k_mut; // dq over k
            break;
          }
          const cl::status st = loss.backward(a, b, g);
          require(st.code() == cl::errc::invalid_argument, "backward accepted overlapping outputs", st);
          require(all_sentinel(buf), "a refused backward wrote an output", st);
          require(std::memcmp(in_p.q.data(), q_before.data(), q_before.size() * sizeof(T)) == 0 &&
                      std::memcmp(in_p.k.data(), k_before.data(), k_before.size() * sizeof(T)) == 0,
                  "a refused backward wrote an input",
                  st);
        }
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
    require(!temp_ok || valid(loss.temperature().validate()), "an accepted temperature policy left its domain");
    require(!scal_ok || valid(loss.scaler().validate()), "an accepted scaler left the states its rule can reach");
  }
  // save() after restore() of a save reproduces it.
  const typename L::checkpoint last = loss.save();
  const cl::status restored = loss.restore(last);
  require(restored.ok() || !temp_ok || !scal_ok, "a saved state does not restore", restored);
  require(same_bytes(last, loss.save()), "save() after restore() differs");
}

template <class T, class Algorithm>
void with_policies(byte_reader& in)
{
  namespace tp = cl::temperature;
  // One input in three draws its taus and bounds near the domain's edges, with learning rates that can reach them.
  const bool edges = in.byte() % 3 == 0;
  auto tau_setting = [&](float typical)
  {
    return edges ? in.edge_tau() : in.setting(typical);
  };
  const float tau = tau_setting(0.07f);
  const float lr = in.setting(1e-3f) * (edges && in.byte() % 2 ? 1e20f : 1.0f);
  const cl::optimizer opt =
      in.byte() % 2 == 0 ? cl::optimizer::adam(lr, 0.9f, in.byte() % 2 ? 0.999f : in.setting(0.5f), in.setting(1e-8f))
                         : cl::optimizer::sgd(lr, in.byte() % 2 ? 0.0f : in.setting(0.5f));
  cl::scaler::dynamic dyn = in.byte() % 3 == 0   ? cl::scaler::dynamic::paddle_dygraph()
                            : in.byte() % 2 == 0 ? cl::scaler::dynamic::paddle_static()
                                                 : cl::scaler::dynamic::torch();
  dyn.scale = in.setting(65536.0f);
  dyn.growth_interval = static_cast<std::int32_t>(in.below(5));
  dyn.backoff_interval = 1 + static_cast<std::int32_t>(in.below(3));
  if (in.byte() % 4 == 0)
  {
    dyn.growth_factor = in.setting(2.0f);
    dyn.backoff_factor = in.setting(0.5f);
  }
  if (edges)
  {
    // Scales at the ends of what the rule reaches (0, subnormal, 2^127, inf) and floors / caps around them.
    const float scales[] = {0.0f, std::ldexp(1.0f, -149), std::ldexp(1.0f, 127), INFINITY, 1.0f};
    dyn.scale = scales[in.below(5)];
    if (in.byte() % 2)
    {
      dyn.min_scale = scales[in.below(5)];
      dyn.max_scale = scales[in.below(5)];
    }
  }
  const cl::scaler::static_scale fixed_scale(in.setting(1.0f));
  // Each policy is built twice, in memory filled with two different bytes: their saves must be equal. (The make
  // functions read no input: both copies get the same settings.)
  alignas(64) unsigned char tb[2][512], sb[2][128];
  const unsigned char garbage[2] = {in.byte(), static_cast<unsigned char>(~in.byte())};
  auto go = [&](auto make_t, auto make_s)
  {
    using Temp = decltype(make_t());
    using Scal = decltype(make_s());
    static_assert(sizeof(Temp) <= sizeof(tb[0]) && sizeof(Scal) <= sizeof(sb[0]));
    const Temp& t1 = build_in<Temp>(tb[0], garbage[0], make_t);
    const Temp& t2 = build_in<Temp>(tb[1], garbage[1], make_t);
    const Scal& s1 = build_in<Scal>(sb[0], garbage[0], make_s);
    const Scal& s2 = build_in<Scal>(sb[1], garbage[1], make_s);
    run<T, Temp, Scal, Algorithm>(in, t1, s1, t2, s2);
  };
  auto dynamic = [&]
  {
    return dyn;
  };
  auto constant = [&]
  {
    return fixed_scale;
  };
  switch (in.byte() % 6)
  {
  case 0:
  {
    auto make = [&]
    {
      return tp::fixed(tau);
    };
    go(make, constant);
    break;
  }
  case 1:
  {
    auto make = [&]
    {
      return tp::learnable(tau, opt);
    };
    go(make, dynamic);
    break;
  }
  case 2:
  {
    const float tau_min = tau_setting(0.01f), tau_max = tau_setting(1.0f);
    auto make = [&]
    {
      return tp::clamped(tau, tau_min, tau_max, opt);
    };
    go(make, dynamic);
    break;
  }
  case 3:
  {
    const auto unfreeze = static_cast<std::int64_t>(in.below(3));
    const bool bounded = in.byte() % 2 == 0;
    const float tau_min = bounded ? tau_setting(0.01f) : 0.0f;
    const float tau_max = bounded ? tau_setting(1.0f) : std::numeric_limits<float>::infinity();
    auto make = [&]
    {
      return tp::freeze_then_learn(tau, unfreeze, opt, tau_min, tau_max);
    };
    go(make, dynamic);
    break;
  }
  case 4:
  {
    const auto kind = in.byte() % 2 ? tp::schedule_kind::linear : tp::schedule_kind::cosine;
    const float tau_end = tau_setting(0.01f);
    const auto duration = static_cast<std::int64_t>(in.below(8));
    auto make = [&]
    {
      return tp::schedule(kind, tau, tau_end, duration);
    };
    go(make, constant);
    break;
  }
  default:
  {
    const float headroom = in.setting(16.0f), retreat = in.setting(0.5f);
    const float tau_max = edges ? tau_setting(1.0f) : 1.0f;
    auto make = [&]
    {
      return tp::range_guard(tau, opt, headroom, retreat, 1.0f, tau_max);
    };
    go(make, dynamic);
    break;
  }
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

/// The policy-free call (core.hpp) against the stateful loss with a fixed temperature and a static scale: the same
/// verdicts for the same inputs, the same bits when accepted, and a refused call (a bad logit or loss scale, a backward
/// without a forward, outputs over the inputs) writes nothing, counts no pass, and keeps a ready forward.
template <class T, class Algorithm>
static void run_core(byte_reader& in)
{
  const fuzz_problem<T> fp(in, 30, 36, 24);
  const cl::problem<T> p = fp.problem();
  const float tau = in.setting(0.07f), ls = in.setting(256.0f);
  const float s = cl::temperature::fixed(tau).scale(); // the loss's s for this tau, so both see the same bits
  // The logit bias: SigLIP's -10 scaled for an objective that takes one, 0 for the others, and sometimes any value
  // (non-finite, or nonzero for an objective without a bias: both refused, naming it).
  const bool has_bias = cl::objectives::traits_of(p).has_bias;
  const bool any_bias = in.byte() % 5 == 0;
  const float bias = any_bias ? in.value() : (has_bias ? in.setting(-10.0f) : 0.0f);
  const T seven = cl::element_traits<T>::from_float(7.0f);
  std::vector<T> dq(fp.n_q * fp.dim + 1, seven), dk(fp.n_k * fp.dim + 1, seven);
  std::vector<T> dq1(fp.n_q * fp.dim + 1), dk1(fp.n_k * fp.dim + 1);
  cl::core<T, Algorithm> core(1 + static_cast<unsigned>(in.below(2)));
  cl::loss<T, cl::temperature::fixed, cl::scaler::static_scale, Algorithm> l(
      cl::temperature::fixed(tau), cl::scaler::static_scale(ls), 1);
  const bool bias_set = l.set_logit_bias(cl::logit_bias::fixed(bias)).ok();
  require(bias_set == std::isfinite(bias), "set_logit_bias: a finite bias refused or a non-finite one accepted");
  cl::step::backward_values b;
  const cl::status early = core.backward(ls, dq.data(), dk.data(), b);
  require(!early.ok() && all_sentinel(dq) && all_sentinel(dk),
          "core: a backward without a forward was not refused, or wrote",
          early);
  cl::core_values v;
  const bool split = in.byte() % 2 == 0;
  cl::status st;
  if (split)
  {
    cl::step::forward_values f;
    st = core.forward(p, s, bias, f);
    if (st.ok())
    {
      // Outputs over the inputs are refused and keep the forward ready.
      const cl::status alias = core.backward(ls, const_cast<T*>(fp.q.data()), dk.data(), b);
      require(!alias.ok() && all_sentinel(dk), "core: a backward into q was accepted or wrote", alias);
      st = core.backward(ls, dq.data(), dk.data(), b);
      if (!st.ok())
      {
        // Only the loss scale, which forward does not see, may refuse it.
        require(st.argument() == "loss_scale" && all_sentinel(dq) && all_sentinel(dk) && core.passes() == 0,
                "core: the backward of an accepted forward was refused, or wrote",
                st);
        return;
      }
      v.loss = f.loss;
      v.grad_logit_scale = b.grad_logit_scale / ls;
      v.grad_logit_bias = b.grad_logit_bias / ls;
    }
  }
  else
  {
    st = core.step(p, s, bias, ls, dq.data(), dk.data(), v);
  }
  if (st.ok() && (!bias_set || (!has_bias && bias != 0.0f)))
  {
    require(false, "core: a non-finite logit bias, or a nonzero one for an objective without a bias, was accepted");
  }
  if (!bias_set)
  {
    return; // the loss holds no such bias to compare with
  }
  cl::step_record rec;
  const cl::status st1 = l.step(p, dq1.data(), dk1.data(), rec);
  if (!st.ok())
  {
    require(all_sentinel(dq) && all_sentinel(dk), "core: a refused call wrote an output", st);
    require(core.passes() == 0, "core: a refused call counted a pass", st);
    // Every refusal of the loss is one of core's (core also checks s and the loss scale itself, where the loss's
    // policies would refuse them first: both must refuse).
    require(!st1.ok() || !(s > 0.0f) || !std::isfinite(s) || !(ls > 0.0f) || !std::isfinite(ls),
            "core refused what the loss accepted",
            st);
    return;
  }
  require(core.passes() == 1, "core: an accepted pass was not counted");
  // The loss may refuse where core does not only for its policies' own domains (fixed's tau, static_scale's bound).
  require(st1.ok() || st1.code() == cl::errc::invalid_temperature || st1.code() == cl::errc::invalid_scaler,
          "core accepted what the loss refused",
          st1);
  if (!st1.ok())
  {
    return;
  }
  require(std::memcmp(dq.data(), dq1.data(), (dq.size() - 1) * sizeof(T)) == 0 &&
              std::memcmp(dk.data(), dk1.data(), (dk.size() - 1) * sizeof(T)) == 0,
          "core and the loss wrote different gradients");
  require(same_bytes(v.loss, rec.loss) && same_bytes(v.grad_logit_scale, rec.grad_logit_scale) &&
              same_bytes(v.grad_logit_bias, rec.grad_logit_bias),
          "core and the loss report different values");
}

/// Ranks out of step over 2-3 thread ranks (tests/thread_comm.hpp): one rank skips a whole step or one finish_step at
/// an input-chosen step, with or without the caller's iteration. No rank may hang (the thread world's watchdog names a
/// hang), and every rank's first failure must be what docs/distributed.md says: a refusal naming "step" on every rank
/// when the mismatch is detectable (a skipped finish_step; a skipped step with an iteration) and a later call exists,
/// or, when the skipping rank has simply finished first, the others' "has returned" (over MPI: a wait).
static void run_out_of_step(byte_reader& in)
{
  using L = cl::distributed::loss<float,
                                  cl::temperature::learnable,
                                  cl::scaler::static_scale,
                                  cl::algorithm::fused,
                                  contrastive_test::thread_comm>;
  const int ranks = 2 + static_cast<int>(in.below(2));
  const std::size_t rows = 1 + in.below(6), dim = 1 + in.below(8);
  const int steps = 2 + static_cast<int>(in.below(3));
  const bool with_iteration = in.byte() % 2 == 0;
  const int skipper = static_cast<int>(in.below(static_cast<std::size_t>(ranks)));
  const int skip_at = static_cast<int>(in.below(static_cast<std::size_t>(steps)));
  const int kind = static_cast<int>(in.below(3)); // 0: no skip, 1: a whole step, 2: one finish_step
  std::vector<std::vector<float>> q(static_cast<std::size_t>(ranks)), k(q.size());
  for (std::size_t r = 0; r < q.size(); ++r)
  {
    for (auto* v : {&q[r], &k[r]})
    {
      v->resize(rows * dim);
      for (float& x : *v)
      {
        const float y = in.value();
        x = std::isfinite(y) && std::fabs(y) < 4.0f ? y : 0.5f;
      }
    }
  }
  std::vector<std::vector<cl::status>> got(q.size());
  contrastive_test::run_ranks(
      ranks,
      [&](contrastive_test::thread_comm c)
      {
        const std::size_t r = static_cast<std::size_t>(c.rank());
        L dist(c, cl::temperature::learnable(0.07f), {}, 1);
        std::vector<float> dq(rows * dim), dk(rows * dim);
        const cl::problem<float> p{q[r].data(), k[r].data(), rows, rows, dim};
        for (int it = 0; it < steps; ++it)
        {
          const bool skip = c.rank() == skipper && it == skip_at;
          if (skip && kind == 1)
          {
            continue;
          }
          cl::step_record rec;
          got[r].push_back(
              dist.forward_backward(p, dq.data(), dk.data(), rec, with_iteration ? it : cl::distributed::no_iteration));
          if (!got[r].back().ok())
          {
            return;
          }
          if (skip && kind == 2)
          {
            continue;
          }
          got[r].push_back(dist.finish_step(rec));
          if (!got[r].back().ok())
          {
            return;
          }
        }
      },
      std::chrono::seconds(60));
  const bool last = skip_at == steps - 1;
  const bool detectable = kind == 2 || (kind == 1 && with_iteration);
  for (std::size_t r = 0; r < got.size(); ++r)
  {
    const cl::status* first = nullptr;
    for (const cl::status& st : got[r])
    {
      require(st.message().find("a hang") == std::string::npos, "out of step: a rank hung", st);
      if (!st.ok() && first == nullptr)
      {
        first = &st;
      }
    }
    if (kind == 0)
    {
      require(first == nullptr, "ranks in step refused a call", first != nullptr ? *first : cl::status{});
      continue;
    }
    if (first == nullptr)
    {
      // Only the undetectable case may pass everything, on the rank that skipped (its later calls paired with the
      // others' earlier ones) or when its skip came last (nothing after it).
      require(!detectable || (last && static_cast<int>(r) == skipper), "out of step: a mismatch was not refused");
      continue;
    }
    const bool refused = first->code() == cl::errc::invalid_argument && first->argument() == "step";
    const bool returned =
        first->code() == cl::errc::communication_error && first->message().find("has returned") != std::string::npos;
    require(refused || returned, "out of step: a first failure that is neither a refusal nor a returned rank", *first);
    require(!(detectable && !last) || refused, "out of step: a detectable mismatch was not refused", *first);
  }
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size)
{
  byte_reader in(data, size);
  in.allow_edges(in.byte() % 4 == 0);
  switch (in.byte() % 13)
  {
  case 11:
    run_core<float, cl::algorithm::fused>(in);
    break;
  case 12:
    run_core<__half, cl::algorithm::chunked>(in);
    break;
  case 10:
    run_out_of_step(in);
    break;
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
