// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#include "support.hpp"

#include <contrastive/host/amx.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include <malloc.h>
#include <time.h>
#include <unistd.h>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

// ---------------------------------------------------------------------------------------------------------------------
// Heap tracker: the replaceable global allocation functions of this binary.
namespace
{
std::atomic<std::size_t> g_live{0};
std::atomic<std::size_t> g_peak{0};

void note_alloc(void* p) noexcept
{
  if (p == nullptr)
  {
    return;
  }
  const std::size_t now = g_live.fetch_add(malloc_usable_size(p), std::memory_order_relaxed) + malloc_usable_size(p);
  std::size_t seen = g_peak.load(std::memory_order_relaxed);
  while (now > seen && !g_peak.compare_exchange_weak(seen, now, std::memory_order_relaxed))
  {
  }
}

void note_free(void* p) noexcept
{
  if (p != nullptr)
  {
    g_live.fetch_sub(malloc_usable_size(p), std::memory_order_relaxed);
  }
}

void* checked_alloc(std::size_t n, std::size_t align)
{
  void* p = nullptr;
  if (align <= alignof(std::max_align_t))
  {
    p = std::malloc(n == 0 ? 1 : n);
  }
  else if (posix_memalign(&p, align, n == 0 ? align : n) != 0)
  {
    p = nullptr;
  }
  if (p == nullptr)
  {
    throw std::bad_alloc();
  }
  note_alloc(p);
  return p;
}

void* nothrow_alloc(std::size_t n, std::size_t align) noexcept
{
  try
  {
    return checked_alloc(n, align);
  }
  catch (...)
  {
    return nullptr;
  }
}

void release(void* p) noexcept
{
  note_free(p);
  std::free(p);
}
} // namespace

void* operator new(std::size_t n)
{
  return checked_alloc(n, 0);
}
void* operator new[](std::size_t n)
{
  return checked_alloc(n, 0);
}
void* operator new(std::size_t n, std::align_val_t a)
{
  return checked_alloc(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a)
{
  return checked_alloc(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept
{
  return nothrow_alloc(n, 0);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept
{
  return nothrow_alloc(n, 0);
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept
{
  return nothrow_alloc(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept
{
  return nothrow_alloc(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept
{
  release(p);
}
void operator delete[](void* p) noexcept
{
  release(p);
}
void operator delete(void* p, std::size_t) noexcept
{
  release(p);
}
void operator delete[](void* p, std::size_t) noexcept
{
  release(p);
}
void operator delete(void* p, std::align_val_t) noexcept
{
  release(p);
}
void operator delete[](void* p, std::align_val_t) noexcept
{
  release(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept
{
  release(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept
{
  release(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept
{
  release(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept
{
  release(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept
{
  release(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept
{
  release(p);
}

namespace contrastive_bench
{
namespace heap
{
std::size_t live() noexcept
{
  return g_live.load(std::memory_order_relaxed);
}
std::size_t peak() noexcept
{
  return g_peak.load(std::memory_order_relaxed);
}
void reset_peak() noexcept
{
  g_peak.store(g_live.load(std::memory_order_relaxed), std::memory_order_relaxed);
}
} // namespace heap

void reset_rss_peak() noexcept
{
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w"))
  {
    std::fputs("5", f); // 5: reset the peak resident set size to the current one
    std::fclose(f);
  }
}

std::size_t rss_peak() noexcept
{
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr)
  {
    return 0;
  }
  char line[256];
  std::size_t kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr)
  {
    if (std::strncmp(line, "VmHWM:", 6) == 0)
    {
      kib = std::strtoull(line + 6, nullptr, 10);
      break;
    }
  }
  std::fclose(f);
  return kib * 1024;
}

double process_cpu_seconds() noexcept
{
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

std::size_t physical_memory() noexcept
{
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : 0;
}

std::string format_bytes(double bytes)
{
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4)
  {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", bytes, units[u]);
  return buf;
}

// ---------------------------------------------------------------------------------------------------------------------
// Configuration.
namespace
{
config g_config;
roofline g_roofline;

bool parse_size(const char* s, std::size_t& out)
{
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (end == s || *end != '\0')
  {
    return false;
  }
  out = static_cast<std::size_t>(v);
  return true;
}

bool parse_double(const char* s, double& out)
{
  char* end = nullptr;
  const double v = std::strtod(s, &end);
  if (end == s || *end != '\0' || !(v >= 0.0))
  {
    return false;
  }
  out = v;
  return true;
}

/// Sets field `name` from text `value`; false if the name is unknown or the value malformed.
bool set_field(config& c, const std::string& name, const char* value, bool& known)
{
  known = true;
  std::size_t z = 0;
  if (name == "max_n")
  {
    return parse_size(value, c.max_n);
  }
  if (name == "max_d")
  {
    return parse_size(value, c.max_d);
  }
  if (name == "warmup_max_n")
  {
    return parse_size(value, c.warmup_max_n);
  }
  if (name == "single_shot_n")
  {
    return parse_size(value, c.single_shot_n);
  }
  if (name == "single_rep_n")
  {
    return parse_size(value, c.single_rep_n);
  }
  if (name == "copy_mib")
  {
    return parse_size(value, c.copy_mib);
  }
  if (name == "budget_mib")
  {
    return parse_size(value, c.budget_mib);
  }
  if (name == "threads")
  {
    const bool ok = parse_size(value, z);
    c.threads = static_cast<unsigned>(z);
    return ok;
  }
  if (name == "mem_cap_gib")
  {
    return parse_double(value, c.mem_cap_gib);
  }
  if (name == "roofline_seconds")
  {
    return parse_double(value, c.roofline_seconds);
  }
  known = false;
  return false;
}

const char* const field_names[] = {"max_n",
                                   "max_d",
                                   "warmup_max_n",
                                   "single_shot_n",
                                   "single_rep_n",
                                   "threads",
                                   "mem_cap_gib",
                                   "roofline_seconds",
                                   "copy_mib",
                                   "budget_mib"};
} // namespace

std::string config::parse(int& argc, char** argv)
{
  for (const char* name : field_names)
  {
    std::string env = "CONTRASTIVE_BENCH_";
    for (const char* p = name; *p != '\0'; ++p)
    {
      env += static_cast<char>(*p >= 'a' && *p <= 'z' ? *p - 'a' + 'A' : *p);
    }
    if (const char* v = std::getenv(env.c_str()))
    {
      bool known = false;
      if (!set_field(*this, name, v, known))
      {
        return "bad value for " + env + ": '" + v + "'";
      }
    }
  }
  int out = 1;
  for (int i = 1; i < argc; ++i)
  {
    const std::string arg = argv[i];
    const std::string prefix = "--contrastive_";
    if (arg.compare(0, prefix.size(), prefix) != 0)
    {
      argv[out++] = argv[i];
      continue;
    }
    const std::size_t eq = arg.find('=');
    if (eq == std::string::npos)
    {
      return "flag needs a value: " + arg;
    }
    const std::string name = arg.substr(prefix.size(), eq - prefix.size());
    bool known = false;
    if (!set_field(*this, name, arg.c_str() + eq + 1, known))
    {
      return known ? "bad value in " + arg : "unknown flag " + arg;
    }
  }
  argc = out;
  argv[argc] = nullptr;
  return "";
}

std::size_t config::mem_cap_bytes() const
{
  if (mem_cap_gib > 0.0)
  {
    return static_cast<std::size_t>(mem_cap_gib * 1073741824.0);
  }
  return physical_memory() / 2;
}

std::string config::describe() const
{
  char buf[256];
  std::snprintf(
      buf,
      sizeof buf,
      "max_n=%zu max_d=%zu mem_cap=%s threads=%u warmup_max_n=%zu single_shot_n=%zu single_rep_n=%zu copy_mib=%zu "
      "budget_mib=%zu",
      max_n,
      max_d,
      format_bytes(static_cast<double>(mem_cap_bytes())).c_str(),
      threads,
      warmup_max_n,
      single_shot_n,
      single_rep_n,
      copy_mib,
      budget_mib);
  return buf;
}

const config& run_config()
{
  return g_config;
}
config& mutable_run_config()
{
  return g_config;
}
const roofline& machine_roofline()
{
  return g_roofline;
}
void set_machine_roofline(const roofline& r)
{
  g_roofline = r;
}

// ---------------------------------------------------------------------------------------------------------------------
// Roofline measurements.
namespace
{
#if defined(__AVX512F__)
using vreg = __m512;
constexpr int lanes = 16;
inline vreg vset1(float x)
{
  return _mm512_set1_ps(x);
}
inline vreg vfma(vreg a, vreg b, vreg c)
{
  return _mm512_fmadd_ps(a, b, c);
}
inline float vsum(vreg a)
{
  float t[16];
  _mm512_storeu_ps(t, a);
  float s = 0.0f;
  for (float x : t)
  {
    s += x;
  }
  return s;
}
#elif defined(__AVX__) && defined(__FMA__)
using vreg = __m256;
constexpr int lanes = 8;
inline vreg vset1(float x)
{
  return _mm256_set1_ps(x);
}
inline vreg vfma(vreg a, vreg b, vreg c)
{
  return _mm256_fmadd_ps(a, b, c);
}
inline float vsum(vreg a)
{
  float t[8];
  _mm256_storeu_ps(t, a);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#else
using vreg = float;
constexpr int lanes = 1;
inline vreg vset1(float x)
{
  return x;
}
inline vreg vfma(vreg a, vreg b, vreg c)
{
  return __builtin_fmaf(a, b, c);
}
inline float vsum(vreg a)
{
  return a;
}
#endif

constexpr int accumulators = 16; // 2 FMA ports x 4-cycle latency needs >= 8 independent chains; 16 leaves margin
constexpr std::size_t inner = 4096;

/// Runs `blocks` x `inner` steps of 16 independent FMA chains; returns a value that depends on all of them.
float fma_chains(std::size_t blocks, float seed)
{
  vreg acc[accumulators];
  for (int i = 0; i < accumulators; ++i)
  {
    acc[i] = vset1(seed + 0.001f * static_cast<float>(i));
  }
  const vreg m = vset1(0.999999f);
  const vreg a = vset1(1.0e-6f);
  for (std::size_t b = 0; b < blocks; ++b)
  {
    for (std::size_t s = 0; s < inner; ++s)
    {
      for (int i = 0; i < accumulators; ++i)
      {
        acc[i] = vfma(acc[i], m, a);
      }
    }
    // Keeps the compiler from collapsing the loop: the chains stay live through an opaque barrier.
    __asm__ volatile("" : "+m"(acc));
  }
  float t = 0.0f;
  for (int i = 0; i < accumulators; ++i)
  {
    t += vsum(acc[i]);
  }
  return t;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool have_bf16_dot = true;
/// The same chains on vdpbf16ps (16 lanes x 2 bfloat16 products per instruction, float accumulation).
float bf16_dot_chains(std::size_t blocks, float seed)
{
  __m512 acc[accumulators];
  for (int i = 0; i < accumulators; ++i)
  {
    acc[i] = _mm512_set1_ps(seed + 0.001f * static_cast<float>(i));
  }
  const __m512bh m = (__m512bh)_mm512_set1_epi32(0x3f803f80); // (1, 1)
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x358637bd); // (~1e-6, ~1e-6)
  for (std::size_t b = 0; b < blocks; ++b)
  {
    for (std::size_t s = 0; s < inner; ++s)
    {
      for (int i = 0; i < accumulators; ++i)
      {
        acc[i] = _mm512_dpbf16_ps(acc[i], m, a);
      }
    }
    __asm__ volatile("" : "+m"(acc));
  }
  float t = 0.0f;
  for (int i = 0; i < accumulators; ++i)
  {
    float lane[16];
    _mm512_storeu_ps(lane, acc[i]);
    for (float x : lane)
    {
      t += x;
    }
  }
  return t;
}
#else
constexpr bool have_bf16_dot = false;
float bf16_dot_chains(std::size_t, float)
{
  return 0.0f;
}
#endif

#if CONTRASTIVE_AMX_COMPILED
/// The same chains on the AMX tiles (tdpbf16ps: 16 x 16 results of 16 bfloat16 pairs each), where amx::active():
/// four C tiles, so that consecutive instructions are independent; one step is one instruction.
CONTRASTIVE_AMX_TARGET float amx_dot_chains(std::size_t blocks, float seed)
{
  namespace amx = contrastive::host::amx;
  alignas(64) std::uint32_t ab[16 * 16];
  alignas(64) float c[16 * 16];
  std::fill(ab, ab + 16 * 16, 0x358637bdu); // (~1e-6, ~1e-6)
  std::fill(c, c + 16 * 16, seed);
  amx::hardware_tiles t;
  t.configure();
  for (int ti = 0; ti < 4; ++ti)
  {
    t.load_c(ti, c, 16);
  }
  t.load_a(0, ab, 16);
  t.load_a(1, ab, 16);
  t.load_b(0, ab, 16);
  t.load_b(1, ab, 16);
  static_assert(accumulators % 4 == 0, "four tiles per round");
  for (std::size_t b = 0; b < blocks; ++b)
  {
    for (std::size_t s = 0; s < inner; ++s)
    {
      for (int i = 0; i < accumulators; i += 4)
      {
        t.dot(); // four independent tdpbf16ps, one per C tile
      }
    }
  }
  float total = 0.0f;
  t.store_c(0, c, 16);
  total += c[0];
  t.store_c(3, c, 16);
  total += c[255];
  t.release();
  return total;
}
#endif

/// Runs `body(worker)` on `threads` threads started together; returns the wall time of the slowest.
template <class F>
double timed_parallel(unsigned threads, F&& body)
{
  std::atomic<unsigned> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  auto run = [&](unsigned w)
  {
    ready.fetch_add(1);
    while (!go.load(std::memory_order_acquire))
    {
    }
    body(w);
  };
  for (unsigned w = 1; w < threads; ++w)
  {
    pool.emplace_back(run, w);
  }
  while (ready.load() + 1 < threads)
  {
  }
  const auto t0 = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  ready.fetch_add(1);
  body(0u);
  for (auto& t : pool)
  {
    t.join();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

volatile float g_sink = 0.0f;

double thread_cpu_seconds() noexcept
{
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
} // namespace

namespace
{
/// `chains(blocks, seed)` on `threads` threads for about `seconds`, `flops_per_step` FLOPs per accumulator step.
template <class Chains>
fma_rate measure_chains(unsigned threads, double seconds, Chains chains, double flops_per_step)
{
  threads = std::max(1u, threads);
  // Calibrate the block count on one thread so that a trial lasts about `seconds`.
  const auto t0 = std::chrono::steady_clock::now();
  g_sink = chains(4, 1.0f);
  const double t_block = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 4.0;
  const std::size_t blocks = std::max<std::size_t>(1, static_cast<std::size_t>(seconds / std::max(t_block, 1e-9)));
  std::vector<float> sinks(threads, 0.0f);
  std::vector<double> cpu(threads, 0.0);
  const double t = timed_parallel(threads,
                                  [&](unsigned w)
                                  {
                                    const double c0 = thread_cpu_seconds();
                                    sinks[w] = chains(blocks, 1.0f + static_cast<float>(w));
                                    cpu[w] = thread_cpu_seconds() - c0;
                                  });
  for (float s : sinks)
  {
    g_sink = g_sink + s;
  }
  const double per_thread = flops_per_step * accumulators * static_cast<double>(inner) * static_cast<double>(blocks);
  fma_rate r{per_thread * threads / t, 0.0};
  for (double c : cpu)
  {
    r.flops_per_cpu += per_thread / c / threads;
  }
  return r;
}
} // namespace

fma_rate measure_fma_flops(unsigned threads, double seconds)
{
  return measure_chains(threads, seconds, fma_chains, 2.0 * lanes);
}

fma_rate measure_bf16_dot_flops(unsigned threads, double seconds)
{
  if (!have_bf16_dot)
  {
    return fma_rate{0.0, 0.0};
  }
#if CONTRASTIVE_AMX_COMPILED
  if (contrastive::host::amx::active())
  {
    return measure_chains(threads, seconds, amx_dot_chains, 4.0 * 16 * 16 * 16);
  }
#endif
  return measure_chains(threads, seconds, bf16_dot_chains, 4.0 * 16);
}

double measure_copy_bytes(unsigned threads, std::size_t bytes, double seconds)
{
  threads = std::max(1u, threads);
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  const std::size_t share = bytes / threads;
  auto copy_once = [&](unsigned w)
  {
    const std::size_t begin = w * share;
    const std::size_t n = w + 1 == threads ? bytes - begin : share;
    std::memcpy(dst.data() + begin, src.data() + begin, n);
  };
  const double t1 = timed_parallel(threads, copy_once); // also faults the pages in
  const int reps = std::max(1, static_cast<int>(seconds / std::max(t1, 1e-6)));
  double best = 1e300;
  for (int r = 0; r < reps; ++r)
  {
    best = std::min(best, timed_parallel(threads, copy_once));
  }
  g_sink = g_sink + static_cast<float>(dst[bytes / 2]);
  return 2.0 * static_cast<double>(bytes) / best;
}

roofline measure_roofline(unsigned threads, double seconds_per_trial, int trials, std::size_t copy_bytes)
{
  roofline r;
  r.threads = threads;
  for (int t = 0; t < trials; ++t)
  {
    const fma_rate all = measure_fma_flops(threads, seconds_per_trial);
    r.fma_flops = std::max(r.fma_flops, all.flops);
    r.fma_flops_per_cpu = std::max(r.fma_flops_per_cpu, all.flops_per_cpu);
    r.fma_flops_1thread = std::max(r.fma_flops_1thread, measure_fma_flops(1, seconds_per_trial / 2).flops);
    const fma_rate bf16 = measure_bf16_dot_flops(threads, seconds_per_trial);
    r.bf16_flops = std::max(r.bf16_flops, bf16.flops);
    r.bf16_flops_per_cpu = std::max(r.bf16_flops_per_cpu, bf16.flops_per_cpu);
  }
  r.copy_bytes = measure_copy_bytes(threads, copy_bytes, seconds_per_trial * trials);
  return r;
}
} // namespace contrastive_bench
