// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
// algorithm::chunked on the device (cuBLAS): against float64 and the host chunked algorithm, several chunks, every
// element type and objective, CUDA graph capture, and the argument checks (which run without a GPU).
#include "device_util.cuh"
#include "test_util.hpp"

#include <contrastive/contrastive.hpp>
#include <contrastive/device/chunked.cuh>
#include <contrastive/device/core.cuh>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace cl = contrastive;
namespace ct = contrastive_test;

namespace
{
template <class T>
using dloss = cl::device::loss<T, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::chunked>;

struct handle
{
  cublasHandle_t h = nullptr;
  handle()
  {
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS)
    {
      h = nullptr;
    }
  }
  ~handle()
  {
    if (h != nullptr)
    {
      cublasDestroy(h);
    }
  }
};

cl::scaler::dynamic scaler_at(float scale)
{
  cl::scaler::dynamic d = cl::scaler::dynamic::torch();
  d.scale = scale;
  d.growth_interval = 100;
  return d;
}

struct case_t
{
  std::size_t n_q, n_k, dim;
  cl::objective obj;
  bool labels;
  std::size_t chunk_rows; // 0: default budget (one chunk here)
};

const case_t cases[] = {
    {300, 300, 64, cl::objective::symmetric, false, 64},
    {300, 300, 64, cl::objective::symmetric, false, 0},
    {200, 500, 40, cl::objective::info_nce, true, 128},
    {129, 129, 17, cl::objective::info_nce, false, 64},
    {1, 1, 8, cl::objective::symmetric, false, 0},
    // Several row tiles (256 rows) and column tiles (128) of the statistics pass, a column tail that is no multiple
    // of 4 (scalar loads and stores beside the 16-byte ones), several chunks, and one chunk with labels.
    {1297, 1297, 40, cl::objective::symmetric, false, 576},
    {600, 1301, 24, cl::objective::info_nce, true, 0},
};

/// A case's random inputs (rows, labels) on the host and the device, the gradient outputs poisoned (all-ones bytes:
/// NaN in every element type) until the step writes them.
template <class T>
struct device_inputs
{
  std::vector<T> q, k;
  std::vector<std::int32_t> labels;
  ct::device_buffer<T> d_q, d_k, d_dq, d_dk;
  ct::device_buffer<std::int32_t> d_labels;

  device_inputs(std::size_t n_q, std::size_t n_k, std::size_t dim, std::uint32_t seed)
      : q(ct::random_rows<T>(n_q, dim, seed)), k(ct::random_rows<T>(n_k, dim, seed + 1)),
        labels(ct::random_labels(n_q, n_k, seed + 2)), d_q(q.size()), d_k(k.size()), d_dq(q.size()), d_dk(k.size()),
        d_labels(labels.size())
  {
  }
  bool ready()
  {
    return d_q.upload(q) == cudaSuccess && d_k.upload(k) == cudaSuccess && d_labels.upload(labels) == cudaSuccess &&
           d_dq.poison(0xff) == cudaSuccess && d_dk.poison(0xff) == cudaSuccess;
  }
};

/// The host chunked loss's step with the policies a device step started from, against that device step's state
/// `after`: one step counted, the same loss scale, tau within 1e-3 (the recorded gradients agree within their
/// tolerance, not to the bit). Returns the host loss's logit bias after the step.
template <class T, class State>
float expect_host_policies(const device_inputs<T>& in,
                           const cl::problem<T>& device_problem,
                           const cl::temperature::learnable& temperature,
                           float scale,
                           const cl::logit_bias& bias,
                           const State& after)
{
  cl::loss<T, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::chunked> host(temperature,
                                                                                            scaler_at(scale));
  EXPECT_TRUE(host.set_logit_bias(bias).ok());
  std::vector<T> hq(in.q.size()), hk(in.k.size());
  cl::step_record hrec;
  const cl::problem<T> p{in.q.data(),
                         in.k.data(),
                         device_problem.n_q,
                         device_problem.n_k,
                         device_problem.dim,
                         device_problem.labels != nullptr ? in.labels.data() : nullptr,
                         device_problem.obj};
  EXPECT_TRUE(host.step(p, hq.data(), hk.data(), hrec).ok());
  EXPECT_EQ(after.step, 1);
  EXPECT_EQ(after.scaler.loss_scale(), host.scaler().loss_scale());
  EXPECT_NEAR(after.temperature.tau(), host.temperature().tau(), 1e-3 * host.temperature().tau());
  return host.bias().value;
}

/// One step on the device and the same step on the host (float64 reference); compares loss, dQ, dK,
/// d loss / d log s and the policy updates.
template <class T>
void check_case(const case_t& c, std::uint32_t seed, bool tiles = false)
{
  SCOPED_TRACE(std::string(cl::element_traits<T>::name) + " n_q " + std::to_string(c.n_q) + " n_k " +
               std::to_string(c.n_k) + " dim " + std::to_string(c.dim) + " chunk " + std::to_string(c.chunk_rows) +
               " " + cl::to_string(c.obj) + (tiles ? " fused_tiles" : ""));
  using L = dloss<T>;
  using tol = ct::tolerance<T, cl::algorithm::chunked>;
  device_inputs<T> in(c.n_q, c.n_k, c.dim, seed);
  ASSERT_TRUE(in.ready());
  auto& [q, k, labels, d_q, d_k, d_dq, d_dk, d_labels] = in;
  ct::device_buffer<typename L::state_type> d_state(1);
  typename L::state_type st;
  const float scale = std::is_same_v<T, float> ? 1.0f : 256.0f;
  ASSERT_TRUE(L::make_state(cl::temperature::learnable(0.05f, cl::optimizer::adam(1e-2f)), scaler_at(scale), st).ok());
  ASSERT_EQ(cudaMemcpy(d_state.ptr, &st, sizeof st, cudaMemcpyHostToDevice), cudaSuccess);
  cl::problem<T> p{d_q.ptr, d_k.ptr, c.n_q, c.n_k, c.dim, c.labels ? d_labels.ptr : nullptr, c.obj};
  handle h;
  ASSERT_NE(h.h, nullptr);
  const cl::chunk_options opts{c.chunk_rows, 0, tiles};
  std::size_t bytes = 0;
  ASSERT_EQ(L::step(nullptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, 0, opts), cudaSuccess);
  ct::device_buffer<char> temp(bytes);
  // The tile path runs wherever it can (16-bit, dim % 8 == 0, aligned cudaMalloc pointers, sm_80+).
  cl::device::chunked_phases::layout lay{};
  ASSERT_EQ(L::make_layout(p, opts, lay), cudaSuccess);
  const bool expect_tiles =
      tiles && !std::is_same_v<T, float> && c.dim % 8 == 0 && cl::device::chunked_phases::device_runs_tiles();
  EXPECT_EQ(lay.tiles, expect_tiles);
  ASSERT_EQ(L::step(temp.ptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, 0, opts), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  typename L::state_type after;
  ASSERT_EQ(cudaMemcpy(&after, d_state.ptr, sizeof after, cudaMemcpyDeviceToHost), cudaSuccess);
  const cl::step_record& rec = after.record;
  ASSERT_EQ(rec.first_nonfinite, cl::nonfinite_site::none);
  EXPECT_FALSE(rec.skipped);

  const ct::reference ref = ct::compute_reference(ct::to_double(q),
                                                  ct::to_double(k),
                                                  c.n_q,
                                                  c.n_k,
                                                  c.dim,
                                                  c.labels ? labels.data() : nullptr,
                                                  c.obj,
                                                  1.0 / double(0.05f));
  EXPECT_NEAR(rec.loss, ref.loss, tol::loss(ref.max_abs_logit));
  // The device rounds G to T for the tensor-core products: one more rounding of u_T than the host's float G.
  const double grad_tol = tol::grad(ref.max_abs_logit) + 2.0 * tol::u_t;
  EXPECT_LE(ct::max_rel_error(d_dq.download(), ref.dq, 1.0 / scale), grad_tol);
  EXPECT_LE(ct::max_rel_error(d_dk.download(), ref.dk, 1.0 / scale), grad_tol);
  EXPECT_NEAR(rec.grad_logit_scale, ref.grad_logit_scale, grad_tol * (1.0 + ref.max_abs_logit) + 1e-6);

  // The host chunked algorithm with the same policies reaches the same policy state (bit-exact when the recorded
  // gradient is the same float; here within its tolerance, so compare the record instead).
  (void)expect_host_policies(
      in, p, cl::temperature::learnable(0.05f, cl::optimizer::adam(1e-2f)), scale, cl::logit_bias{}, after);
}
} // namespace

TEST(DeviceChunked, MatchesFloat64AndTheHostPath)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  std::uint32_t seed = 500;
  for (const case_t& c : cases)
  {
    check_case<float>(c, seed += 3);
    check_case<__half>(c, seed += 3);
    check_case<__nv_bfloat16>(c, seed += 3);
  }
}

// chunk_options::fused_tiles: the tensor-core tile kernels (statistics and G_c in registers). Shapes that leave
// partial row and column tiles, a depth tail (dim 72 = 2 x 32 + 8), labels, several chunks and one.
const case_t tile_cases[] = {
    {300, 300, 64, cl::objective::symmetric, false, 64},
    {300, 300, 64, cl::objective::symmetric, false, 0},
    {200, 500, 40, cl::objective::info_nce, true, 128},
    {129, 129, 16, cl::objective::info_nce, false, 64},
    {1, 1, 8, cl::objective::symmetric, false, 0},
    {700, 700, 72, cl::objective::symmetric, false, 256},
    {1000, 1300, 128, cl::objective::info_nce, true, 0},
    {129, 129, 17, cl::objective::symmetric, false, 64}, // dim % 8 != 0: the cuBLAS path runs
};

TEST(DeviceChunked, FusedTilesMatchFloat64AndTheHostPath)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  std::uint32_t seed = 1500;
  for (const case_t& c : tile_cases)
  {
    check_case<__half>(c, seed += 3, true);
    check_case<__nv_bfloat16>(c, seed += 3, true);
    check_case<float>(c, seed += 3, true); // float: option ignored
  }
}

// The two paths compute the same products in float from the same 16-bit inputs; only the order of the float sums
// differs, so loss and gradients agree to a few float ulps before the final rounding to T.
template <class T>
void paths_agree(const case_t& c, std::uint32_t seed)
{
  SCOPED_TRACE(std::string(cl::element_traits<T>::name) + " n " + std::to_string(c.n_q) + " dim " +
               std::to_string(c.dim));
  using L = cl::device::loss<T, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::chunked>;
  const auto q = ct::random_rows<T>(c.n_q, c.dim, seed);
  const auto k = ct::random_rows<T>(c.n_k, c.dim, seed + 1);
  const auto labels = ct::random_labels(c.n_q, c.n_k, seed + 2);
  ct::device_buffer<T> d_q(q.size()), d_k(k.size());
  ct::device_buffer<std::int32_t> d_labels(labels.size());
  ASSERT_EQ(d_q.upload(q), cudaSuccess);
  ASSERT_EQ(d_k.upload(k), cudaSuccess);
  ASSERT_EQ(d_labels.upload(labels), cudaSuccess);
  cl::problem<T> p{d_q.ptr, d_k.ptr, c.n_q, c.n_k, c.dim, c.labels ? d_labels.ptr : nullptr, c.obj};
  handle h;
  typename L::state_type st;
  ASSERT_TRUE(L::make_state(cl::temperature::fixed(0.02f), cl::scaler::static_scale(1024.0f), st).ok());
  std::vector<T> dq[2], dk[2];
  cl::step_record rec[2];
  for (int tiles = 0; tiles < 2; ++tiles)
  {
    ct::device_buffer<T> d_dq(q.size()), d_dk(k.size());
    ct::device_buffer<typename L::state_type> d_state(1);
    ASSERT_EQ(cudaMemcpy(d_state.ptr, &st, sizeof st, cudaMemcpyHostToDevice), cudaSuccess);
    const cl::chunk_options opts{c.chunk_rows, 0, tiles == 1};
    std::size_t bytes = 0;
    ASSERT_EQ(L::step(nullptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, 0, opts), cudaSuccess);
    ct::device_buffer<char> temp(bytes);
    ASSERT_EQ(L::step(temp.ptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, 0, opts), cudaSuccess);
    typename L::state_type after;
    ASSERT_EQ(cudaMemcpy(&after, d_state.ptr, sizeof after, cudaMemcpyDeviceToHost), cudaSuccess);
    rec[tiles] = after.record;
    dq[tiles] = d_dq.download();
    dk[tiles] = d_dk.download();
  }
  EXPECT_NEAR(rec[1].loss, rec[0].loss, 1e-5 * (1.0 + std::fabs(rec[0].loss)));
  EXPECT_NEAR(rec[1].max_logit, rec[0].max_logit, 1e-5 * (1.0 + std::fabs(rec[0].max_logit)));
  EXPECT_NEAR(rec[1].grad_logit_scale, rec[0].grad_logit_scale, 1e-4 * (1.0 + std::fabs(rec[0].grad_logit_scale)));
  // G is rounded to T on both paths: an element can land one T ulp apart, which the products average out.
  const double tol = 4.0 * ct::tolerance<T, cl::algorithm::chunked>::u_t;
  EXPECT_LE(ct::max_rel_error(dq[1], ct::to_double(dq[0]), 1.0), tol);
  EXPECT_LE(ct::max_rel_error(dk[1], ct::to_double(dk[0]), 1.0), tol);
}

TEST(DeviceChunked, FusedTilesAgreeWithTheCublasPath)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  if (!cl::device::chunked_phases::device_runs_tiles())
  {
    GTEST_SKIP() << "the tile kernels need compute capability 8.0 or later";
  }
  std::uint32_t seed = 2500;
  for (const case_t& c : {case_t{1024, 1024, 256, cl::objective::symmetric, false, 256},
                          case_t{777, 2000, 96, cl::objective::info_nce, true, 0},
                          case_t{4096, 4096, 512, cl::objective::symmetric, false, 0}})
  {
    paths_agree<__nv_bfloat16>(c, seed += 3);
    paths_agree<__half>(c, seed += 3);
  }
}

// fp16 at a batch where P ~ 1/n is below fp16's normal range: the tile path scales G by 2^k like the cuBLAS path
// (whose own large-N test compares with float64), so the two agree to the element type's rounding.
TEST(DeviceChunked, FusedTilesHalfGradientsKeepTheirDigitsAtLargeN)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  if (!cl::device::chunked_phases::device_runs_tiles())
  {
    GTEST_SKIP() << "the tile kernels need compute capability 8.0 or later";
  }
  paths_agree<__half>({20000, 20000, 32, cl::objective::symmetric, false, 4096}, 901);
}

// fp16 at a batch where P ~ 1/n is below fp16's normal range: the gradient scaled by 2^k keeps its digits.
TEST(DeviceChunked, HalfGradientsKeepTheirDigitsAtLargeN)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  check_case<__half>({20000, 20000, 32, cl::objective::symmetric, false, 4096}, 900);
}

// A step captured in a CUDA graph on a non-default stream, replayed twice, equals two eager steps.
TEST(DeviceChunked, GraphReplayEqualsEagerSteps)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  using T = __nv_bfloat16;
  using L = dloss<T>;
  const std::size_t n = 256, dim = 32;
  const auto q = ct::random_rows<T>(n, dim, 77);
  const auto k = ct::random_rows<T>(n, dim, 78);
  ct::device_buffer<T> d_q(q.size()), d_k(k.size()), d_dq(q.size()), d_dk(k.size());
  ASSERT_EQ(d_q.upload(q), cudaSuccess);
  ASSERT_EQ(d_k.upload(k), cudaSuccess);
  typename L::state_type st;
  ASSERT_TRUE(L::make_state(cl::temperature::learnable(0.07f), cl::scaler::dynamic::torch(), st).ok());
  cl::problem<T> p{d_q.ptr, d_k.ptr, n, n, dim, nullptr, cl::objective::symmetric};
  handle h;
  for (const bool tiles : {false, true})
  {
    SCOPED_TRACE(tiles ? "fused_tiles" : "cuBLAS logits");
    const cl::chunk_options opts{64, 0, tiles};
    std::size_t bytes = 0;
    ASSERT_EQ(L::step(nullptr, bytes, p, d_dq.ptr, d_dk.ptr, nullptr, h.h, 0, opts), cudaErrorInvalidValue);
    ct::device_buffer<typename L::state_type> d_state(1);
    ASSERT_EQ(L::step(nullptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, 0, opts), cudaSuccess);
    ct::device_buffer<char> temp(bytes);

    auto run = [&](bool graph)
    {
      cudaStream_t s;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      // On the step's own stream: a non-blocking stream is not ordered after a legacy-stream cudaMemcpy, whose
      // pageable-memory DMA may still be in flight when it returns.
      cudaMemcpyAsync(d_state.ptr, &st, sizeof st, cudaMemcpyHostToDevice, s);
      if (graph)
      {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        EXPECT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
        EXPECT_EQ(L::step(temp.ptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, s, opts), cudaSuccess);
        EXPECT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
        EXPECT_EQ(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
        EXPECT_EQ(cudaGraphLaunch(ge, s), cudaSuccess);
        EXPECT_EQ(cudaGraphLaunch(ge, s), cudaSuccess);
        EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
      }
      else
      {
        for (int i = 0; i < 2; ++i)
        {
          EXPECT_EQ(L::step(temp.ptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, s, opts), cudaSuccess);
        }
        EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      }
      cudaStreamDestroy(s);
      typename L::state_type out;
      cudaMemcpy(&out, d_state.ptr, sizeof out, cudaMemcpyDeviceToHost);
      return std::make_tuple(out, d_dq.download(), d_dk.download());
    };
    const auto [s1, dq1, dk1] = run(false);
    const auto [s2, dq2, dk2] = run(true);
    EXPECT_EQ(s1.step, 2);
    EXPECT_EQ(s2.step, 2);
    EXPECT_EQ(s1.record.loss, s2.record.loss);
    EXPECT_EQ(s1.temperature.tau(), s2.temperature.tau());
    EXPECT_EQ(s1.scaler.loss_scale(), s2.scaler.loss_scale());
    EXPECT_EQ(0, std::memcmp(dq1.data(), dq2.data(), dq1.size() * sizeof(T)));
    EXPECT_EQ(0, std::memcmp(dk1.data(), dk2.data(), dk1.size() * sizeof(T)));
  }
}

// The chunked loss's status calls: arguments named as check() names them; a cuBLAS result keeps cuBLAS's code (and
// maps to the cudaError_t the CUB-style call returns); without a device the default size query's free-memory read
// fails, and the status carries CUDA's code, the same the CUB-style call returns.
TEST(DeviceChunked, StatusCallsNameTheArgumentOrCarryTheLibrarysCode)
{
  using L = dloss<float>;
  float dummy[4] = {};
  typename L::state_type* state = reinterpret_cast<typename L::state_type*>(dummy); // never dereferenced
  const cl::problem<float> p{dummy, dummy + 1, 1, 1, 1, nullptr, cl::objective::symmetric};
  std::size_t bytes = 0;
  EXPECT_EQ(L::step_status(nullptr, bytes, p, dummy + 2, dummy + 3, state, nullptr).argument(), "handle");

  const cl::status blas = cl::device::chunked_phases::cublas_status(CUBLAS_STATUS_ALLOC_FAILED, "cublasGemmEx");
  EXPECT_EQ(blas.code(), cl::errc::cuda_error);
  EXPECT_EQ(blas.argument(), "cublasGemmEx");
  EXPECT_EQ(blas.native().api, cl::native_api::cublas);
  EXPECT_EQ(blas.native().code, static_cast<int>(CUBLAS_STATUS_ALLOC_FAILED));
  EXPECT_NE(blas.message().find("CUBLAS_STATUS_ALLOC_FAILED"), std::string::npos) << blas.message();
  EXPECT_EQ(L::cuda_error_of(blas), cudaErrorMemoryAllocation);
  EXPECT_EQ(L::cuda_error_of(cl::detail::cuda_status(cudaErrorLaunchFailure, "x")), cudaErrorLaunchFailure);
  EXPECT_TRUE(cl::device::chunked_phases::cublas_status(CUBLAS_STATUS_SUCCESS, "x").ok());

  const auto h = reinterpret_cast<cublasHandle_t>(dummy); // a size query never uses the handle
  std::size_t query = 0, query_cub = 0;
  const cl::status st = L::forward_backward_status(nullptr, query, p, dummy + 2, dummy + 3, state, h);
  const cudaError_t e = L::forward_backward(nullptr, query_cub, p, dummy + 2, dummy + 3, state, h);
  EXPECT_EQ(L::cuda_error_of(st), e) << st.message();
  if (!contrastive_test::device_unavailable().empty())
  {
    ASSERT_FALSE(st.ok()) << "without a device the default size query cannot read the free memory";
    EXPECT_EQ(st.native().api, cl::native_api::cuda);
    EXPECT_NE(st.native().code, 0);
    return;
  }
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(query, query_cub);
  std::size_t short_bytes = query - 1;
  EXPECT_EQ(L::forward_backward_status(dummy, short_bytes, p, dummy + 2, dummy + 3, state, h).code(),
            cl::errc::workspace_too_small);
}

// A default size query (it reads the free memory) made while the stream is being captured in global mode neither
// fails nor invalidates the capture, and its bytes run a step captured after it.
TEST(DeviceChunked, DefaultSizeQueryDuringGraphCapture)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  using T = __nv_bfloat16;
  using L = dloss<T>;
  const std::size_t n = 256, dim = 32;
  const auto q = ct::random_rows<T>(n, dim, 81);
  const auto k = ct::random_rows<T>(n, dim, 82);
  ct::device_buffer<T> d_q(q.size()), d_k(k.size()), d_dq(q.size()), d_dk(k.size());
  ct::device_buffer<typename L::state_type> d_state(1);
  ASSERT_EQ(d_q.upload(q), cudaSuccess);
  ASSERT_EQ(d_k.upload(k), cudaSuccess);
  typename L::state_type st;
  ASSERT_TRUE(L::make_state(cl::temperature::learnable(0.07f), cl::scaler::dynamic::torch(), st).ok());
  cl::problem<T> p{d_q.ptr, d_k.ptr, n, n, dim, nullptr, cl::objective::symmetric};
  handle h;
  ASSERT_NE(h.h, nullptr);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(L::upload_state(st, d_state.ptr, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  std::size_t bytes = 0;
  cudaGraph_t g = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(L::step(nullptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, s), cudaSuccess);
  EXPECT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  EXPECT_GT(bytes, 0u);
  if (g != nullptr)
  {
    cudaGraphDestroy(g);
  }
  ct::device_buffer<char> temp(bytes);
  EXPECT_EQ(L::step(temp.ptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, s), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaStreamDestroy(s);
}

// Argument checks happen before any CUDA call, so they run without a GPU too.
TEST(DeviceChunked, RefusesBadArgumentsWithoutTouchingTheDevice)
{
  using L = dloss<float>;
  float dummy[4] = {};
  typename L::state_type* state = reinterpret_cast<typename L::state_type*>(dummy); // never dereferenced
  cl::problem<float> p{dummy, dummy + 1, 1, 1, 1, nullptr, cl::objective::symmetric};
  std::size_t bytes = 0;
  // No handle.
  EXPECT_EQ(L::step(nullptr, bytes, p, dummy + 2, dummy + 3, state, nullptr), cudaErrorInvalidValue);
  // Empty and oversized problems.
  cl::problem<float> empty = p;
  empty.n_q = 0;
  EXPECT_EQ(L::step(nullptr, bytes, empty, dummy + 2, dummy + 3, state, nullptr), cudaErrorInvalidValue);
  cl::problem<float> huge = p;
  huge.n_q = huge.n_k = (std::size_t(1) << 30) + 1;
  EXPECT_EQ(L::step(nullptr, bytes, huge, dummy + 2, dummy + 3, state, reinterpret_cast<cublasHandle_t>(dummy)),
            cudaErrorInvalidValue);
  // check() names what each refusal is about (host code: no device needed).
  const auto h = reinterpret_cast<cublasHandle_t>(dummy);
  EXPECT_EQ(L::check(p, dummy + 2, dummy + 3, state, nullptr).argument(), "handle");
  EXPECT_EQ(L::check(p, dummy + 2, dummy + 3, nullptr, h).argument(), "d_state");
  EXPECT_EQ(L::check(empty, dummy + 2, dummy + 3, state, h).argument(), "n_q");
  // Beyond the device's limits: addresses 1 TiB apart, so the operands do not overlap (never dereferenced).
  const auto at = [](int tib)
  {
    return reinterpret_cast<float*>(static_cast<std::uintptr_t>(tib) << 40);
  };
  cl::problem<float> far = huge;
  far.q = at(1);
  far.k = at(2);
  EXPECT_EQ(L::check(far, at(3), at(4), state, h).code(), cl::errc::size_overflow);
  EXPECT_EQ(L::check(far, at(3), at(4), state, h).argument(), "n_q");
  cl::problem<float> sig = p;
  sig.obj = cl::objective::sigmoid;
  EXPECT_TRUE(L::check(sig, dummy + 2, dummy + 3, state, h).ok()); // the sigmoid objective runs chunked
  EXPECT_TRUE(L::check(p, dummy + 2, dummy + 3, state, h).ok());
  // Chunk rows: multiples of 64, at most every row; without free memory known (0), the default's floor: S_c and G_c
  // in 384 MiB, and at least 256 rows. Given rows or a budget keep their meaning whatever is free.
  cl::problem<__nv_bfloat16> b{nullptr, nullptr, 65536, 65536, 512, nullptr, cl::objective::symmetric};
  EXPECT_EQ(dloss<__nv_bfloat16>::chunk_rows_for(b, {}, false, 0), (std::size_t(384) << 20) / (65536 * 6) / 64 * 64);
  cl::problem<__nv_bfloat16> wide{
      nullptr, nullptr, std::size_t(1) << 20, std::size_t(1) << 20, 512, nullptr, cl::objective::symmetric};
  EXPECT_EQ(dloss<__nv_bfloat16>::chunk_rows_for(wide, {}, false, 0), 256u);
  for (const std::size_t free_bytes : {std::size_t(0), std::size_t(139) << 30})
  {
    EXPECT_EQ(dloss<__nv_bfloat16>::chunk_rows_for(b, {100, 0}, false, free_bytes), 128u);
    EXPECT_EQ(dloss<__nv_bfloat16>::chunk_rows_for(b, {0, std::size_t(1) << 20}, false, free_bytes), 64u);
    EXPECT_EQ(dloss<__nv_bfloat16>::chunk_rows_for(wide, {256, 0}, false, free_bytes), 256u);
  }
  EXPECT_EQ(dloss<float>::chunk_rows_for(p, {}, false, 0), 64u);
  EXPECT_EQ(dloss<float>::chunk_rows_for(p, {}, false, std::size_t(139) << 30), 64u);
}

// The default chunk from free memory (no CUDA call: the free bytes are given). N = 2^20 on an H200 (139 GiB free):
// 4096 rows instead of 256, so the dK accumulator is read and written 256 times per step instead of 4096
// (docs/performance.md); less free memory lowers the rows, never below the old default.
TEST(DeviceChunked, DefaultChunkComesFromFreeMemory)
{
  using L = dloss<__nv_bfloat16>;
  namespace cd = cl::device::chunked_phases;
  const std::size_t gib = std::size_t(1) << 30;
  cl::problem<__nv_bfloat16> wide{
      nullptr, nullptr, std::size_t(1) << 20, std::size_t(1) << 20, 512, nullptr, cl::objective::symmetric};
  // The fixed buffers (dK accumulator, statistics): what a layout of no chunk rows holds.
  cd::layout fixed{};
  std::size_t cub = 1;
  ASSERT_EQ(L::layout_for_rows(wide, false, 0, cub, fixed), cudaSuccess);
  EXPECT_GE(fixed.total, (std::size_t(1) << 20) * 512 * sizeof(float));
  const std::size_t per_row = L::chunk_bytes_per_row(wide, false) + 512 * sizeof(float);
  EXPECT_EQ(L::chunk_bytes_per_row(wide, false), (std::size_t(1) << 20) * 6);
  for (const std::size_t free_bytes : {80 * gib, 40 * gib, 20 * gib})
  {
    SCOPED_TRACE(free_bytes / gib);
    const std::size_t rows = L::chunk_rows_for(wide, {}, false, free_bytes);
    EXPECT_EQ(rows % 64, 0u);
    const std::size_t quarter = (free_bytes - fixed.total) / 4; // what a quarter of the rest holds, whole 64s
    EXPECT_LE(rows * per_row, quarter);
    EXPECT_GT((rows + 64) * per_row, quarter);
  }
  EXPECT_EQ(L::chunk_rows_for(wide, {}, false, 80 * gib), 3264u);
  EXPECT_EQ(L::chunk_rows_for(wide, {}, false, 139 * gib), cd::default_max_rows); // 5824 would fit
  EXPECT_EQ(cd::default_max_rows, 4096u);
  EXPECT_EQ(L::chunk_rows_for(wide, {}, false, std::size_t(1) << 50), 4096u); // not every row, however much is free
  // Little free memory: never below the old default (256 rows here).
  EXPECT_EQ(L::chunk_rows_for(wide, {}, false, 3 * gib), 256u);
  EXPECT_EQ(L::chunk_rows_for(wide, {}, false, gib), 256u); // less than the fixed buffers
  cl::problem<__nv_bfloat16> b{nullptr, nullptr, 65536, 65536, 512, nullptr, cl::objective::symmetric};
  EXPECT_EQ(L::chunk_rows_for(b, {}, false, 139 * gib), 4096u);
  EXPECT_EQ(L::chunk_rows_for(b, {}, false, 2 * gib), 1216u); // (2 GiB - 128 MiB) / 4 / (384 KiB + 2 KiB)
  EXPECT_EQ(L::chunk_rows_for(b, {}, false, 0), 1024u);       // no device: the 384 MiB floor
  // At most every row; a floor above 4096 rows (narrow keys: 384 MiB holds 65536 rows of 1024 keys) stays the floor.
  cl::problem<__nv_bfloat16> small{nullptr, nullptr, 300, 300, 64, nullptr, cl::objective::symmetric};
  EXPECT_EQ(L::chunk_rows_for(small, {}, false, 139 * gib), 320u);
  cl::problem<__nv_bfloat16> narrow{
      nullptr, nullptr, std::size_t(1) << 20, 1024, 512, nullptr, cl::objective::symmetric};
  EXPECT_EQ(L::chunk_rows_for(narrow, {}, false, 139 * gib), 65536u);
  // fused_tiles: ~2.1 bytes per chunk logit instead of 6: the same quarter holds ~2.8x the rows.
  EXPECT_EQ(L::chunk_rows_for(wide, {0, 0, true}, true, 139 * gib), 4096u);
  EXPECT_EQ(L::chunk_rows_for(wide, {0, 0, true}, true, 20 * gib), 2112u); // 704 rows without fused_tiles
  EXPECT_EQ(L::chunk_rows_for(wide, {0, 0, true}, true, 0), L::floor_rows_for(wide, true));
}

// The grids' y dimension runs over a chunk's rows (one row of blocks per 128 rows for the tile kernels, per
// chunked_phases::stat_rows for the statistics pass) and holds at most 65535 blocks: a chunk asked to hold more rows
// (20 Mi queries of 64 keys, whose whole workspace fits an H200) holds what the grid reaches. No GPU needed.
TEST(DeviceChunked, ChunkRowsFitTheGrid)
{
  using L = dloss<__nv_bfloat16>;
  namespace cd = cl::device::chunked_phases;
  const cl::problem<__nv_bfloat16> tall{
      nullptr, nullptr, std::size_t(20) << 20, 64, 32, nullptr, cl::objective::info_nce};
  for (const bool tiles : {false, true})
  {
    SCOPED_TRACE(tiles ? "tiles" : "statistics pass");
    const std::size_t most = std::size_t(65535) * (tiles ? std::size_t(128) : std::size_t(cd::stat_rows));
    cd::layout w{};
    std::size_t cub = 1;
    ASSERT_EQ(L::layout_for_rows(tall, tiles, tall.n_q, cub, w), cudaSuccess);
    EXPECT_EQ(w.chunk_rows, most);
    ASSERT_EQ(L::layout_for_rows(tall, tiles, 4096, cub, w), cudaSuccess);
    EXPECT_EQ(w.chunk_rows, 4096u); // below the grid's reach: as asked
  }
}

// algorithm::automatic on the device: the chunked loss whose default chunk holds every row where that whole
// workspace fits a quarter of the free memory (the logits computed once), else chunked's default. No GPU needed.
TEST(DeviceAutomatic, DefaultKeepsEveryRowWhereTheWorkspaceFits)
{
  using A = cl::device::loss<__nv_bfloat16, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::automatic>;
  using C = dloss<__nv_bfloat16>;
  namespace cd = cl::device::chunked_phases;
  const std::size_t gib = std::size_t(1) << 30;
  for (const std::size_t n : {std::size_t(300), std::size_t(16384), std::size_t(65536), std::size_t(1) << 20})
  {
    const cl::problem<__nv_bfloat16> p{nullptr, nullptr, n, n, 768, nullptr, cl::objective::symmetric};
    for (const std::size_t free_bytes : {std::size_t(0), 2 * gib, 8 * gib, 139 * gib})
    {
      SCOPED_TRACE(std::to_string(n) + " free " + std::to_string(free_bytes));
      std::size_t cub = 4096;
      cd::layout every{};
      ASSERT_EQ(A::layout_for_rows(p, false, n, cub, every), cudaSuccess);
      const bool fits = free_bytes != 0 && every.total <= free_bytes / cd::free_divisor;
      const std::size_t rows = A::chunk_rows_for(p, {}, false, free_bytes);
      if (fits)
      {
        EXPECT_GE(rows, n);
      }
      else
      {
        EXPECT_EQ(rows, C::chunk_rows_for(p, {}, false, free_bytes));
      }
      // The step given the query's bytes lays out the query's rows.
      cd::layout query{}, step{};
      ASSERT_EQ(A::layout_for_rows(p, false, rows, cub, query), cudaSuccess);
      ASSERT_EQ(A::layout_to_fit(p, false, query.total, cub, step), cudaSuccess);
      EXPECT_EQ(step.chunk_rows, query.chunk_rows);
      EXPECT_EQ(step.total, query.total);
      // Options with a chunk size run chunked's sizing.
      EXPECT_EQ(A::chunk_rows_for(p, {512, 0, false}, false, free_bytes), C::chunk_rows_for(p, {512, 0, false}));
      // budget_bytes is the one chunk's budget instead of a quarter of free memory: the whole workspace must fit
      // (as the sizing counts it: CUB's few KiB left out, as a size query without a device leaves them out).
      std::size_t no_cub = 1;
      cd::layout sized{};
      ASSERT_EQ(A::layout_for_rows(p, false, n, no_cub, sized), cudaSuccess);
      for (const std::size_t budget : {sized.total - 1, sized.total})
      {
        const std::size_t r = A::chunk_rows_for(p, {0, budget, false}, false, free_bytes);
        if (budget >= sized.total)
        {
          EXPECT_GE(r, n);
        }
        else
        {
          EXPECT_EQ(r, C::chunk_rows_for(p, {}, false, free_bytes));
        }
        cd::layout q{}, s{};
        ASSERT_EQ(A::layout_for_rows(p, false, r, cub, q), cudaSuccess);
        ASSERT_EQ(A::layout_to_fit(p, false, q.total, cub, s), cudaSuccess);
        EXPECT_EQ(s.chunk_rows, q.chunk_rows);
      }
    }
  }
  // What the H200 (139 GiB free) gets at D = 768: one chunk up to N = 65536 (about 24 GiB), 4096 rows beyond.
  const cl::problem<__nv_bfloat16> big{nullptr, nullptr, 65536, 65536, 768, nullptr, cl::objective::symmetric};
  EXPECT_EQ(A::chunk_rows_for(big, {}, false, 139 * gib), 65536u);
  EXPECT_EQ(A::chunk_rows_for(big, {}, false, 8 * gib), C::chunk_rows_for(big, {}, false, 8 * gib));
  const cl::problem<__nv_bfloat16> huge{nullptr, nullptr, 262144, 262144, 768, nullptr, cl::objective::symmetric};
  EXPECT_EQ(A::chunk_rows_for(huge, {}, false, 139 * gib), 4096u);
}

// On the device: automatic's step equals the chunked step with every row in one chunk, bit for bit, and float64.
TEST(DeviceAutomatic, EqualsChunkedWithOneChunkBitForBit)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  using T = __nv_bfloat16;
  using A = cl::device::loss<T, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::automatic>;
  using C = dloss<T>;
  const std::size_t n = 1000, dim = 64;
  device_inputs<T> in(n, n, dim, 4242);
  ASSERT_TRUE(in.ready());
  const cl::problem<T> p{in.d_q.ptr, in.d_k.ptr, n, n, dim, nullptr, cl::objective::symmetric};
  handle h;
  typename A::state_type st;
  ASSERT_TRUE(A::make_state(cl::temperature::learnable(0.05f), scaler_at(256.0f), st).ok());
  auto run = [&](auto tag, const cl::chunk_options& o)
  {
    using L = decltype(tag);
    ct::device_buffer<typename L::state_type> d_state(1);
    EXPECT_EQ(cudaMemcpy(d_state.ptr, &st, sizeof st, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(in.d_dq.poison(0xff), cudaSuccess);
    EXPECT_EQ(in.d_dk.poison(0xff), cudaSuccess);
    std::size_t bytes = 0;
    EXPECT_EQ(L::step(nullptr, bytes, p, in.d_dq.ptr, in.d_dk.ptr, d_state.ptr, h.h, 0, o), cudaSuccess);
    ct::device_buffer<char> temp(bytes);
    EXPECT_EQ(L::step(temp.ptr, bytes, p, in.d_dq.ptr, in.d_dk.ptr, d_state.ptr, h.h, 0, o), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    typename L::state_type out;
    EXPECT_EQ(cudaMemcpy(&out, d_state.ptr, sizeof out, cudaMemcpyDeviceToHost), cudaSuccess);
    return std::make_tuple(out.record, in.d_dq.download(), in.d_dk.download());
  };
  const auto [ra, dqa, dka] = run(A{}, {});
  const auto [rc, dqc, dkc] = run(C{}, {n, 0, false});
  EXPECT_EQ(ra.loss, rc.loss);
  EXPECT_EQ(ra.grad_logit_scale, rc.grad_logit_scale);
  EXPECT_EQ(0, std::memcmp(dqa.data(), dqc.data(), dqa.size() * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(dka.data(), dkc.data(), dka.size() * sizeof(T)));
  const ct::reference ref = ct::compute_reference(
      ct::to_double(in.q), ct::to_double(in.k), n, n, dim, nullptr, cl::objective::symmetric, 1.0 / double(0.05f));
  using tol = ct::tolerance<T, cl::algorithm::chunked>;
  EXPECT_NEAR(ra.loss, ref.loss, tol::loss(ref.max_abs_logit));
  EXPECT_LE(ct::max_rel_error(dqa, ref.dq, 1.0 / 256.0), tol::grad(ref.max_abs_logit) + 2.0 * tol::u_t);
}

// The tile grid's block order (grouped_tile, no GPU needed): every tile of the grid exactly once, groups of 8 row
// tiles walked column by column, so a K tile is loaded from HBM once per 8 row tiles while they stay resident, not
// once per row tile (N = 65536: ~8.6 GB of K per step instead of ~68 GB).
TEST(DeviceChunked, TileGridOrderCoversEveryTileOnce)
{
  namespace td = cl::device::logits_tile;
  for (const auto& [rows, cols] : std::vector<std::pair<int, int>>{
           {1, 1}, {1, 7}, {7, 1}, {8, 8}, {9, 3}, {17, 5}, {32, 512}, {33, 100}, {512, 8}, {64, 8192}})
  {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
    std::vector<int> seen(static_cast<std::size_t>(rows) * cols, 0);
    for (long long l = 0; l < static_cast<long long>(rows) * cols; ++l)
    {
      const td::tile_coord t = td::grouped_tile(l, rows, cols);
      ASSERT_GE(t.row, 0);
      ASSERT_LT(t.row, rows);
      ASSERT_GE(t.col, 0);
      ASSERT_LT(t.col, cols);
      ++seen[static_cast<std::size_t>(t.row) * cols + t.col];
      // Within a group, consecutive blocks step down the group's rows, then to the next column.
      const int first = static_cast<int>(l / (8LL * cols)) * 8;
      EXPECT_GE(t.row, first);
      EXPECT_LT(t.row, first + 8);
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), static_cast<long long>(seen.size()));
  }
  // The first 8 x 3 blocks of a 16 x 4 grid: rows 0-7 of column 0, of column 1, of column 2.
  for (int l = 0; l < 24; ++l)
  {
    const td::tile_coord t = td::grouped_tile(l, 16, 4);
    EXPECT_EQ(t.row, l % 8);
    EXPECT_EQ(t.col, l / 8);
  }
  // A grid as large as the device limits allow (65535 row tiles; 2^30 keys: 2^23 column tiles): no overflow.
  const long long big_rows = 65535, big_cols = 1 << 23;
  const td::tile_coord last = td::grouped_tile(big_rows * big_cols - 1, 65535, 1 << 23);
  EXPECT_EQ(last.row, 65534);
  EXPECT_EQ(last.col, (1 << 23) - 1);
}

// The step's layout from its workspace: the bytes a default size query wrote give exactly the query's rows, whatever
// is free when the step runs (no CUDA call: CUB's bytes and the tile decision are given).
TEST(DeviceChunked, StepLayoutFromTheWorkspaceIsTheQuerys)
{
  namespace cd = cl::device::chunked_phases;
  const std::size_t gib = std::size_t(1) << 30;
  auto check = [&](auto problem, bool tiles)
  {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(problem.q)>>;
    using L = dloss<T>;
    for (const std::size_t free_bytes :
         {std::size_t(0), gib / 2, 3 * gib, 20 * gib, 40 * gib, 80 * gib, 139 * gib, std::size_t(1) << 50})
    {
      SCOPED_TRACE(std::to_string(problem.n_q) + " x " + std::to_string(problem.n_k) + " free " +
                   std::to_string(free_bytes) + (tiles ? " tiles" : ""));
      const std::size_t cub = 4096;
      cd::layout query{}, step{}, bigger{};
      std::size_t c = cub;
      ASSERT_EQ(L::layout_for_rows(problem, tiles, L::chunk_rows_for(problem, {}, tiles, free_bytes), c, query),
                cudaSuccess);
      ASSERT_EQ(L::layout_to_fit(problem, tiles, query.total, cub, step), cudaSuccess);
      EXPECT_EQ(step.chunk_rows, query.chunk_rows);
      EXPECT_EQ(step.total, query.total);
      EXPECT_EQ(step.dk, query.dk);
      // A workspace one byte short of the query's: fewer rows (or the floor, which the step then refuses).
      ASSERT_EQ(L::layout_to_fit(problem, tiles, query.total - 1, cub, bigger), cudaSuccess);
      EXPECT_TRUE(bigger.chunk_rows < query.chunk_rows || bigger.total > query.total - 1);
    }
  };
  using bf = __nv_bfloat16;
  const std::size_t mega = std::size_t(1) << 20;
  check(cl::problem<bf>{nullptr, nullptr, mega, mega, 512, nullptr, cl::objective::symmetric}, false);
  check(cl::problem<bf>{nullptr, nullptr, mega, mega, 512, nullptr, cl::objective::symmetric}, true);
  check(cl::problem<bf>{nullptr, nullptr, 65536, 65536, 512, nullptr, cl::objective::symmetric}, false);
  check(cl::problem<bf>{nullptr, nullptr, 300, 300, 64, nullptr, cl::objective::symmetric}, false);
  check(cl::problem<bf>{nullptr, nullptr, 200000, 50000, 256, nullptr, cl::objective::info_nce}, false);
  check(cl::problem<bf>{nullptr, nullptr, mega, 1024, 512, nullptr, cl::objective::symmetric}, false);
  check(cl::problem<float>{nullptr, nullptr, 100000, 100000, 128, nullptr, cl::objective::symmetric}, false);
  check(cl::problem<__half>{nullptr, nullptr, 20000, 70000, 64, nullptr, cl::objective::info_nce}, true);
}

// fused_tiles sizing: no float chunk, so the same budget holds about 2.8x the rows (G_c in T plus the tile partials);
// float ignores the option; without a device (or below sm_80) the cuBLAS path's sizing applies. Touches the CUDA
// runtime (the device query), with or without a GPU.
TEST(DeviceChunked, FusedTilesSizing)
{
  float dummy[4] = {};
  cl::problem<float> p{dummy, dummy + 1, 1, 1, 1, nullptr, cl::objective::symmetric};
  cl::problem<__nv_bfloat16> b{nullptr, nullptr, 65536, 65536, 512, nullptr, cl::objective::symmetric};
  const std::size_t tile_rows =
      (std::size_t(384) << 20) / cl::device::chunked_phases::tile_bytes_per_row<__nv_bfloat16>(65536) / 64 * 64;
  EXPECT_EQ(dloss<__nv_bfloat16>::chunk_rows_for(b, {0, 0, true}, true, 0), tile_rows);
  EXPECT_GT(tile_rows, 2 * dloss<__nv_bfloat16>::chunk_rows_for(b, {}, false, 0));
  EXPECT_EQ(dloss<float>::chunk_rows_for(p, {0, 0, true}), 64u);
  if (!cl::device::chunked_phases::device_runs_tiles())
  {
    EXPECT_EQ(dloss<__nv_bfloat16>::chunk_rows_for(b, {0, 0, true}), dloss<__nv_bfloat16>::chunk_rows_for(b, {}));
  }
  // Unaligned q (or dim % 8 != 0) never takes the tile path.
  cl::problem<__nv_bfloat16> odd = b;
  odd.q = reinterpret_cast<const __nv_bfloat16*>(std::uintptr_t(2));
  EXPECT_FALSE(cl::device::chunked_phases::use_tiles(odd, {0, 0, true}));
  cl::problem<__nv_bfloat16> narrow = b;
  narrow.dim = 100;
  EXPECT_FALSE(cl::device::chunked_phases::use_tiles(narrow, {0, 0, true}));
}

// Non-finite input and out-of-range labels on the tile path: the same record (site, skip) as the cuBLAS path.
TEST(DeviceChunked, FusedTilesReportNonFiniteLikeTheCublasPath)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  using T = __nv_bfloat16;
  using L = dloss<T>;
  const std::size_t n = 300, dim = 64;
  for (int poison = 0; poison < 3; ++poison) // 0: NaN in q, 1: inf in k, 2: a label past n_k (info_nce)
  {
    SCOPED_TRACE(poison);
    auto q = ct::random_rows<T>(n, dim, 31 + poison);
    auto k = ct::random_rows<T>(n, dim, 41 + poison);
    auto labels = ct::random_labels(n, n, 51 + poison);
    if (poison == 0)
    {
      q[7 * dim + 3] = cl::element_traits<T>::from_float(std::nanf(""));
    }
    else if (poison == 1)
    {
      k[200 * dim + 5] = cl::element_traits<T>::from_float(INFINITY);
    }
    else
    {
      labels[150] = static_cast<std::int32_t>(n + 7);
    }
    ct::device_buffer<T> d_q(q.size()), d_k(k.size()), d_dq(q.size()), d_dk(k.size());
    ct::device_buffer<std::int32_t> d_labels(labels.size());
    ASSERT_EQ(d_q.upload(q), cudaSuccess);
    ASSERT_EQ(d_k.upload(k), cudaSuccess);
    ASSERT_EQ(d_labels.upload(labels), cudaSuccess);
    const cl::problem<T> p{d_q.ptr,
                           d_k.ptr,
                           n,
                           n,
                           dim,
                           poison == 2 ? d_labels.ptr : nullptr,
                           poison == 2 ? cl::objective::info_nce : cl::objective::symmetric};
    typename L::state_type st;
    ASSERT_TRUE(L::make_state(cl::temperature::learnable(0.05f), scaler_at(1024.0f), st).ok());
    handle h;
    typename L::state_type out[2];
    for (int tiles = 0; tiles < 2; ++tiles)
    {
      ct::device_buffer<typename L::state_type> d_state(1);
      ASSERT_EQ(cudaMemcpy(d_state.ptr, &st, sizeof st, cudaMemcpyHostToDevice), cudaSuccess);
      const cl::chunk_options opts{128, 0, tiles == 1};
      std::size_t bytes = 0;
      ASSERT_EQ(L::step(nullptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, 0, opts), cudaSuccess);
      ct::device_buffer<char> temp(bytes);
      ASSERT_EQ(L::step(temp.ptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, 0, opts), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(&out[tiles], d_state.ptr, sizeof out[tiles], cudaMemcpyDeviceToHost), cudaSuccess);
    }
    EXPECT_NE(out[0].record.first_nonfinite, cl::nonfinite_site::none);
    EXPECT_EQ(out[1].record.first_nonfinite, out[0].record.first_nonfinite);
    EXPECT_TRUE(out[1].record.skipped);
    EXPECT_EQ(out[1].record.skipped, out[0].record.skipped);
    EXPECT_EQ(out[1].scaler.loss_scale(), out[0].scaler.loss_scale());
    EXPECT_EQ(out[1].temperature.tau(), out[0].temperature.tau());
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The sigmoid objective (SigLIP) on the device: algorithm::chunked only (S_c by cuBLAS, the loss terms and G_c in one
// element-wise pass per chunk). Against the float64 reference and the host chunked loss with the same policies.

namespace
{
struct sigmoid_case
{
  std::size_t n_q, n_k, dim;
  bool labels;
  std::size_t chunk_rows; // 0: default (one chunk here)
  float tau, bias;        // s = 1/tau; z = s <q, k> + bias
};

const sigmoid_case sigmoid_cases[] = {
    {300, 300, 64, false, 64, 0.1f, -10.0f}, // SigLIP's initial t = 10, b = -10; several chunks
    {200, 500, 40, true, 128, 0.05f, -2.0f}, // labels, rectangular
    {129, 300, 17, false, 0, 0.2f, 0.0f},    // rectangular diagonal (n_q < n_k), dim not a multiple of 8
    {1, 1, 8, false, 0, 0.1f, 1.5f},
};

/// One sigmoid step on the device with a learnable temperature and bias, against float64 and against the host chunked
/// loss's policy updates. `tiles`: chunk_options::fused_tiles asked for (the sigmoid objective ignores it).
template <class T>
void check_sigmoid_case(const sigmoid_case& c, std::uint32_t seed, bool tiles)
{
  SCOPED_TRACE(std::string(cl::element_traits<T>::name) + " n_q " + std::to_string(c.n_q) + " n_k " +
               std::to_string(c.n_k) + " dim " + std::to_string(c.dim) + " chunk " + std::to_string(c.chunk_rows) +
               " tau " + std::to_string(c.tau) + " b " + std::to_string(c.bias) + (c.labels ? " labels" : "") +
               (tiles ? " fused_tiles" : ""));
  using L = dloss<T>;
  using tol = ct::tolerance<T, cl::algorithm::chunked>;
  device_inputs<T> in(c.n_q, c.n_k, c.dim, seed);
  ASSERT_TRUE(in.ready());
  auto& [q, k, labels, d_q, d_k, d_dq, d_dk, d_labels] = in;
  ct::device_buffer<typename L::state_type> d_state(1);
  const float scale = std::is_same_v<T, float> ? 1.0f : 1024.0f;
  const auto temperature = cl::temperature::learnable(c.tau, cl::optimizer::adam(1e-2f));
  const auto bias = cl::logit_bias::learnable(c.bias, cl::optimizer::adam(1e-2f));
  typename L::state_type st;
  ASSERT_TRUE(L::make_state(temperature, scaler_at(scale), bias, st).ok());
  ASSERT_EQ(L::upload_state(st, d_state.ptr), cudaSuccess);
  const cl::problem<T> p{
      d_q.ptr, d_k.ptr, c.n_q, c.n_k, c.dim, c.labels ? d_labels.ptr : nullptr, cl::objective::sigmoid};
  handle h;
  ASSERT_NE(h.h, nullptr);
  const cl::chunk_options opts{c.chunk_rows, 0, tiles};
  cl::device::chunked_phases::layout lay{};
  ASSERT_EQ(L::make_layout(p, opts, lay), cudaSuccess);
  EXPECT_FALSE(lay.tiles);
  std::size_t bytes = 0;
  ASSERT_EQ(L::step(nullptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, 0, opts), cudaSuccess);
  ct::device_buffer<char> temp(bytes);
  const cl::status run = L::forward_backward_status(temp.ptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h, 0, opts);
  ASSERT_TRUE(run.ok()) << run.message();
  typename L::state_type mid;
  ASSERT_EQ(cudaMemcpy(&mid, d_state.ptr, sizeof mid, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(mid.bias_step, 1);
  EXPECT_EQ(mid.bias.value, c.bias); // forward_backward reads the bias, finish_step moves it
  ASSERT_EQ(L::finish_step(d_state.ptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  typename L::state_type after;
  ASSERT_EQ(cudaMemcpy(&after, d_state.ptr, sizeof after, cudaMemcpyDeviceToHost), cudaSuccess);
  const cl::step_record& rec = after.record;
  ASSERT_EQ(rec.first_nonfinite, cl::nonfinite_site::none);
  EXPECT_FALSE(rec.skipped);
  EXPECT_EQ(rec.logit_bias, c.bias);
  EXPECT_EQ(after.bias_step, 0);

  const ct::reference ref = ct::compute_sigmoid_reference(ct::to_double(q),
                                                          ct::to_double(k),
                                                          c.n_q,
                                                          c.n_k,
                                                          c.dim,
                                                          c.labels ? labels.data() : nullptr,
                                                          1.0 / double(c.tau),
                                                          double(c.bias));
  // As the host's float algorithms (core_test's sigmoid cases): the loss to float accuracy of its terms and their
  // sensitivity; the gradients with one more rounding of u_T (G_c is stored in T for the tensor-core products).
  const double loss_tol = 64 * tol::u_f * (1.0 + ref.loss + ref.loss_sensitivity);
  EXPECT_NEAR(rec.loss, ref.loss, loss_tol);
  const double grad_tol = tol::grad(ref.max_abs_logit) + 2.0 * tol::u_t;
  EXPECT_LE(ct::max_rel_error(d_dq.download(), ref.dq, 1.0 / scale), grad_tol);
  EXPECT_LE(ct::max_rel_error(d_dk.download(), ref.dk, 1.0 / scale), grad_tol);
  const double gtol = 64 * grad_tol * (1.0 + ref.loss_sensitivity);
  EXPECT_NEAR(rec.grad_logit_scale, ref.grad_logit_scale, gtol);
  // d loss / d b sums float G (never rounded to T): float accuracy of the terms and of z (u_f |z| each).
  EXPECT_NEAR(rec.grad_logit_bias,
              ref.grad_logit_bias,
              64 * tol::u_f * (1.0 + ref.loss_sensitivity) + 1e-5 * (1.0 + std::fabs(ref.grad_logit_bias)));
  // z = s <q, k> + b from a float product of dim terms: s dim u_f beside the rounding of z itself.
  EXPECT_NEAR(rec.max_logit,
              ref.max_logit,
              8 * tol::u_f * (1.0 + ref.max_abs_logit) + double(c.dim) * tol::u_f / double(c.tau));

  // The host chunked loss with the same policies: the same scaler, and tau and b moved alike (Adam's first step is
  // about lr times the gradient's sign, so both land within a small fraction of lr of each other).
  EXPECT_NEAR(after.bias.value, expect_host_policies(in, p, temperature, scale, bias, after), 1e-3);
  EXPECT_NE(after.bias.value, c.bias);
}
} // namespace

TEST(DeviceChunkedSigmoid, MatchesFloat64AndTheHostPath)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  std::uint32_t seed = 2500;
  for (const sigmoid_case& c : sigmoid_cases)
  {
    for (const bool tiles : {false, true})
    {
      check_sigmoid_case<float>(c, seed += 3, tiles);
      check_sigmoid_case<__half>(c, seed += 3, tiles);
      check_sigmoid_case<__nv_bfloat16>(c, seed += 3, tiles);
    }
  }
}

// What moves the bias: a finite sigmoid step with a learnable bias does; a fixed bias, a skipped sigmoid step (NaN
// in q: site logits, the scaler backs off) and a softmax step do not. The host loss refuses a learnable bias with a
// softmax objective; the device cannot read its state on the host, so its softmax steps ignore the bias (documented).
TEST(DeviceChunkedSigmoid, OnlyAFiniteSigmoidStepMovesALearnableBias)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  using T = __half;
  using L = dloss<T>;
  const std::size_t n = 96, dim = 32;
  handle h;
  ASSERT_NE(h.h, nullptr);
  struct run_case
  {
    const char* what;
    cl::objective obj;
    bool learnable, poison;
    bool moves;
  };
  const run_case runs[] = {
      {"learnable", cl::objective::sigmoid, true, false, true},
      {"fixed", cl::objective::sigmoid, false, false, false},
      {"skipped", cl::objective::sigmoid, true, true, false},
      {"softmax", cl::objective::symmetric, true, false, false},
  };
  for (const run_case& rc : runs)
  {
    SCOPED_TRACE(rc.what);
    auto q = ct::random_rows<T>(n, dim, 71);
    const auto k = ct::random_rows<T>(n, dim, 72);
    if (rc.poison)
    {
      q[5 * dim + 1] = cl::element_traits<T>::from_float(std::nanf(""));
    }
    ct::device_buffer<T> d_q(q.size()), d_k(k.size()), d_dq(q.size()), d_dk(k.size());
    ASSERT_EQ(d_q.upload(q), cudaSuccess);
    ASSERT_EQ(d_k.upload(k), cudaSuccess);
    const cl::logit_bias b =
        rc.learnable ? cl::logit_bias::learnable(-10.0f, cl::optimizer::sgd(1.0f)) : cl::logit_bias::fixed(-10.0f);
    typename L::state_type st;
    ASSERT_TRUE(L::make_state(cl::temperature::learnable(0.1f), scaler_at(1024.0f), b, st).ok());
    ct::device_buffer<typename L::state_type> d_state(1);
    ASSERT_EQ(L::upload_state(st, d_state.ptr), cudaSuccess);
    const cl::problem<T> p{d_q.ptr, d_k.ptr, n, n, dim, nullptr, rc.obj};
    std::size_t bytes = 0;
    ASSERT_EQ(L::step(nullptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h), cudaSuccess);
    ct::device_buffer<char> temp(bytes);
    ASSERT_EQ(L::step(temp.ptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h), cudaSuccess);
    typename L::state_type after;
    ASSERT_EQ(cudaMemcpy(&after, d_state.ptr, sizeof after, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(after.step, 1);
    EXPECT_EQ(after.bias_step, 0);
    EXPECT_EQ(after.record.skipped, rc.poison);
    if (rc.poison)
    {
      EXPECT_EQ(after.record.first_nonfinite, cl::nonfinite_site::logits);
      EXPECT_EQ(after.scaler.loss_scale(), 512.0f);
    }
    if (rc.moves)
    {
      // SGD with lr 1: b moves by exactly -d loss / d b (float).
      EXPECT_EQ(after.bias.value, -10.0f - after.record.grad_logit_bias);
      // At n = 96 each row's positive (z ~ -10: -sigmoid(10) / n) outweighs its 95 negatives (sigmoid(-10) / n
      // each), so d loss / d b ~ -1 and b rises; it falls only once n e^-10 E[e^S] > 1 (n above ~5000).
      EXPECT_LT(after.record.grad_logit_bias, -0.5f);
    }
    else
    {
      EXPECT_EQ(after.bias.value, -10.0f);
    }
    EXPECT_EQ(after.record.logit_bias, rc.obj == cl::objective::sigmoid ? -10.0f : 0.0f);
  }
}

// Without a GPU: the chunked loss takes the sigmoid objective (any n_q <= n_k with the diagonal, labels otherwise),
// lays out one more row buffer (the rows' sums of G) and never the tile path; an invalid bias is refused by
// make_state naming it; fused and materialized refuse the objective by name.
TEST(DeviceChunkedSigmoid, ChecksLayoutAndStateWithoutADevice)
{
  using L = dloss<float>;
  float dummy[16] = {};
  alignas(256) static unsigned char fake_state[sizeof(L::state_type)];
  auto* state = reinterpret_cast<L::state_type*>(fake_state); // never dereferenced
  const auto h = reinterpret_cast<cublasHandle_t>(dummy);
  const cl::problem<float> sig{dummy, dummy + 1, 2, 3, 1, nullptr, cl::objective::sigmoid};
  EXPECT_TRUE(L::check(sig, dummy + 4, dummy + 6, state, h).ok());
  cl::problem<float> tall = sig;
  tall.n_q = 4;
  tall.n_k = 2;
  EXPECT_EQ(L::check(tall, dummy + 8, dummy + 12, state, h).argument(), "labels");
  using F = cl::device::loss<float, cl::temperature::learnable, cl::scaler::dynamic>;
  const cl::status fused = F::check(sig, dummy + 4, dummy + 6, reinterpret_cast<F::state_type*>(fake_state));
  EXPECT_EQ(fused.argument(), "obj");
  EXPECT_NE(fused.message().find("algorithm::chunked"), std::string::npos) << fused.message();

  cl::problem<__nv_bfloat16> big{nullptr, nullptr, 4096, 8192, 512, nullptr, cl::objective::sigmoid};
  big.q = reinterpret_cast<const __nv_bfloat16*>(std::uintptr_t(1) << 20); // aligned, never dereferenced
  big.k = reinterpret_cast<const __nv_bfloat16*>(std::uintptr_t(1) << 30);
  EXPECT_FALSE(cl::device::chunked_phases::use_tiles(big, {0, 0, true}));
  std::size_t cub = 4096; // given: no CUDA call
  cl::device::chunked_phases::layout with{}, without{};
  ASSERT_EQ(dloss<__nv_bfloat16>::layout_for_rows(big, false, 1024, cub, with), cudaSuccess);
  cl::problem<__nv_bfloat16> soft = big;
  soft.obj = cl::objective::info_nce;
  ASSERT_EQ(dloss<__nv_bfloat16>::layout_for_rows(soft, false, 1024, cub, without), cudaSuccess);
  // row_bias: one float per row (256-byte multiple); info_nce's statistics pass has row partials (one per column
  // tile per chunk row) that the sigmoid objective does not.
  const std::size_t row_part = 1024 * cl::device::chunked_phases::stat_col_tiles(8192) * sizeof(float2);
  EXPECT_EQ(with.total + row_part, without.total + 4096 * sizeof(float));
  EXPECT_EQ(with.row_bias, without.col_max); // carved where info_nce's (empty) buffers begin

  L::state_type st;
  EXPECT_TRUE(L::make_state(cl::temperature::learnable(0.1f), cl::scaler::dynamic{}, st).ok());
  EXPECT_EQ(st.bias.value, 0.0f);
  EXPECT_FALSE(st.bias.is_learnable());
  EXPECT_EQ(st.bias_step, 0);
  const cl::status bad =
      L::make_state(cl::temperature::learnable(0.1f), cl::scaler::dynamic{}, cl::logit_bias::fixed(INFINITY), st);
  EXPECT_EQ(bad.code(), cl::errc::invalid_argument);
  EXPECT_EQ(bad.argument(), "logit_bias");
  ASSERT_TRUE(L::make_state(cl::temperature::learnable(0.1f),
                            cl::scaler::dynamic{},
                            cl::logit_bias::learnable(-10.0f, cl::optimizer::adam(1e-3f)),
                            st)
                  .ok());
  EXPECT_EQ(st.bias.value, -10.0f);
  EXPECT_TRUE(st.bias.is_learnable());
}

// ---------------------------------------------------------------------------------------------------------------
// device::core (device/core.cuh): the policy-free device call at the caller's s, b and loss scale.

namespace
{
template <class T, class Algorithm>
using dcore = cl::device::core<T, Algorithm>;

/// The core's pass against the stateful device loss at a fixed temperature and a static scale with the same s, b and
/// loss scale (the same kernels with the same numbers: the same bits), and against float64.
template <class T, class Algorithm>
void core_matches_loss(cl::objective obj, std::uint32_t seed)
{
  const std::size_t n_q = 150, n_k = obj == cl::objective::symmetric ? 150 : 230, dim = 48;
  SCOPED_TRACE(std::string(cl::element_traits<T>::name) + " " + Algorithm::name + " " + cl::to_string(obj));
  using C = dcore<T, Algorithm>;
  using L = cl::device::loss<T, cl::temperature::fixed, cl::scaler::static_scale, Algorithm>;
  constexpr bool chunked = std::is_same_v<Algorithm, cl::algorithm::chunked>;
  device_inputs<T> in(n_q, n_k, dim, seed);
  ASSERT_TRUE(in.ready());
  auto& [q, k, labels, d_q, d_k, d_dq, d_dk, d_labels] = in;
  const bool with_labels = obj != cl::objective::symmetric;
  const cl::problem<T> p{d_q.ptr, d_k.ptr, n_q, n_k, dim, with_labels ? d_labels.ptr : nullptr, obj};
  const float tau = obj == cl::objective::sigmoid ? 0.1f : 0.05f;
  const float s = cl::temperature::fixed(tau).scale(); // the loss's s: both runs see the same bits
  const float b = obj == cl::objective::sigmoid ? -10.0f : 0.0f;
  const float loss_scale = std::is_same_v<T, float> ? 4.0f : 512.0f;
  handle h;
  ASSERT_NE(h.h, nullptr);

  ct::device_buffer<typename C::values_type> d_values(1);
  ASSERT_EQ(d_values.poison(0xff), cudaSuccess);
  std::size_t bytes = 0;
  const auto pass = [&](void* temp) -> cl::status
  {
    if constexpr (chunked)
    {
      return C::step(temp, bytes, p, s, b, loss_scale, in.d_dq.ptr, in.d_dk.ptr, d_values.ptr, h.h);
    }
    else
    {
      return C::step(temp, bytes, p, s, b, loss_scale, in.d_dq.ptr, in.d_dk.ptr, d_values.ptr);
    }
  };
  ASSERT_TRUE(pass(nullptr).ok());
  ct::device_buffer<char> temp(bytes);
  // A workspace one byte short is refused, naming it, and writes nothing: d_values, dq and dk stay poisoned. (chunked:
  // 150 rows are below the default chunk's floor, so no smaller chunk fits the shorter workspace instead.)
  --bytes;
  const cl::status short_ws = pass(temp.ptr);
  EXPECT_EQ(short_ws.code(), cl::errc::workspace_too_small);
  EXPECT_EQ(short_ws.argument(), "temp_bytes");
  ++bytes;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto none_finite = [](const std::vector<T>& v)
  {
    return std::none_of(v.begin(),
                        v.end(),
                        [](T x)
                        {
                          return cl::element_traits<T>::is_finite(x);
                        });
  };
  EXPECT_TRUE(none_finite(d_dq.download()));
  EXPECT_TRUE(none_finite(d_dk.download()));
  typename C::values_type untouched;
  ASSERT_EQ(cudaMemcpy(&untouched, d_values.ptr, sizeof untouched, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::isnan(untouched.record.loss));

  const cl::status run = pass(temp.ptr);
  ASSERT_TRUE(run.ok()) << run.message();
  typename C::values_type v;
  ASSERT_EQ(cudaMemcpy(&v, d_values.ptr, sizeof v, cudaMemcpyDeviceToHost), cudaSuccess);
  const cl::step_record& r = v.record;
  EXPECT_EQ(r.first_nonfinite, cl::nonfinite_site::none);
  EXPECT_EQ(r.loss_scale, loss_scale);
  EXPECT_EQ(v.temperature.scale(), s);
  const auto dq = d_dq.download(), dk = d_dk.download();

  // The stateful device loss with the same numbers.
  typename L::state_type st;
  ASSERT_TRUE(
      L::make_state(cl::temperature::fixed(tau), cl::scaler::static_scale(loss_scale), cl::logit_bias::fixed(b), st)
          .ok());
  ct::device_buffer<typename L::state_type> d_state(1);
  ASSERT_EQ(L::upload_state(st, d_state.ptr), cudaSuccess);
  ASSERT_EQ(d_dq.poison(0xff), cudaSuccess);
  ASSERT_EQ(d_dk.poison(0xff), cudaSuccess);
  std::size_t lbytes = 0;
  if constexpr (chunked)
  {
    ASSERT_TRUE(L::forward_backward_status(nullptr, lbytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h).ok());
    ct::device_buffer<char> ltemp(lbytes);
    ASSERT_TRUE(L::forward_backward_status(ltemp.ptr, lbytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr, h.h).ok());
  }
  else
  {
    ASSERT_TRUE(L::forward_backward_status(nullptr, lbytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr).ok());
    ct::device_buffer<char> ltemp(lbytes);
    ASSERT_TRUE(L::forward_backward_status(ltemp.ptr, lbytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr).ok());
  }
  EXPECT_EQ(lbytes, bytes);
  typename L::state_type after;
  ASSERT_EQ(cudaMemcpy(&after, d_state.ptr, sizeof after, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(r.loss, after.record.loss);
  EXPECT_EQ(r.max_logit, after.record.max_logit);
  EXPECT_EQ(r.grad_logit_scale, after.record.grad_logit_scale);
  EXPECT_EQ(r.grad_logit_bias, after.record.grad_logit_bias);
  EXPECT_EQ(ct::rel_diff(d_dq.download(), dq), 0.0);
  EXPECT_EQ(ct::rel_diff(d_dk.download(), dk), 0.0);

  // And float64: the gradients carry the loss scale, the record's derivatives do not.
  const ct::reference ref = obj == cl::objective::sigmoid
                                ? ct::compute_sigmoid_reference(ct::to_double(q),
                                                                ct::to_double(k),
                                                                n_q,
                                                                n_k,
                                                                dim,
                                                                with_labels ? labels.data() : nullptr,
                                                                double(s),
                                                                double(b))
                                : ct::compute_reference(ct::to_double(q),
                                                        ct::to_double(k),
                                                        n_q,
                                                        n_k,
                                                        dim,
                                                        with_labels ? labels.data() : nullptr,
                                                        obj,
                                                        double(s));
  using tol = ct::tolerance<T, Algorithm>;
  const double grad_tol = tol::grad(ref.max_abs_logit) + 2.0 * tol::u_t;
  EXPECT_NEAR(r.loss, ref.loss, 64 * tol::u_f * (1.0 + ref.loss + ref.loss_sensitivity) + tol::loss(ref.max_abs_logit));
  EXPECT_LE(ct::max_rel_error(dq, ref.dq, 1.0 / loss_scale), grad_tol);
  EXPECT_LE(ct::max_rel_error(dk, ref.dk, 1.0 / loss_scale), grad_tol);
  // d loss / d log s with the tolerances of the device chunked tests above (softmax and sigmoid).
  const double dlogs_tol = obj == cl::objective::sigmoid ? 64 * grad_tol * (1.0 + ref.loss_sensitivity)
                                                         : grad_tol * (1.0 + ref.max_abs_logit) + 1e-6;
  EXPECT_NEAR(r.grad_logit_scale, ref.grad_logit_scale, dlogs_tol);
  if (obj == cl::objective::sigmoid)
  {
    EXPECT_NEAR(r.grad_logit_bias,
                ref.grad_logit_bias,
                64 * tol::u_f * (1.0 + ref.loss_sensitivity) + 1e-5 * (1.0 + std::fabs(ref.grad_logit_bias)));
  }
}
} // namespace

TEST(DeviceCore, MatchesTheDeviceLossBitForBitAndFloat64)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  core_matches_loss<float, cl::algorithm::fused>(cl::objective::symmetric, 3100);
  core_matches_loss<float, cl::algorithm::fused>(cl::objective::info_nce, 3110);
  core_matches_loss<float, cl::algorithm::materialized>(cl::objective::symmetric, 3115);
  core_matches_loss<__nv_bfloat16, cl::algorithm::chunked>(cl::objective::symmetric, 3120);
  core_matches_loss<__half, cl::algorithm::chunked>(cl::objective::sigmoid, 3130);
  core_matches_loss<__nv_bfloat16, cl::algorithm::chunked>(cl::objective::sigmoid, 3140);
}

// Without a GPU: every number and argument the core refuses is named before any CUDA call (no device here, so a
// CUDA call would fail with a CUDA status instead), and the values it uploads hold s, b and the loss scale exactly.
TEST(DeviceCore, RefusesBadNumbersAndArgumentsBeforeAnyCudaCall)
{
  using F = dcore<float, cl::algorithm::fused>;
  using C = dcore<__half, cl::algorithm::chunked>;
  float dummy[16] = {};
  const cl::problem<float> p{dummy, dummy + 1, 2, 2, 1, nullptr, cl::objective::symmetric};
  alignas(256) static unsigned char fake[sizeof(F::values_type) + sizeof(C::values_type)];
  auto* fv = reinterpret_cast<F::values_type*>(fake); // never dereferenced
  auto* cv = reinterpret_cast<C::values_type*>(fake);
  std::size_t bytes = 0;
  // Each refusal as a size query and as a call with a workspace (`fake`, aligned, never dereferenced: an upload or
  // any other CUDA call before the checks would return a CUDA status here, where no device is, instead of the
  // argument's).
  const auto fused = [&](float s, float b, float ls, const cl::problem<float>& prob, F::values_type* v)
  {
    bytes = 1 << 20;
    const cl::status with_workspace = F::step(fake, bytes, prob, s, b, ls, dummy + 4, dummy + 6, v);
    const cl::status query = F::step(nullptr, bytes, prob, s, b, ls, dummy + 4, dummy + 6, v);
    EXPECT_EQ(with_workspace.code(), query.code());
    EXPECT_EQ(with_workspace.argument(), query.argument());
    return query;
  };
  for (const float s : {0.0f, -1.0f, INFINITY, NAN, 1e-36f, 1e36f})
  {
    const cl::status st = fused(s, 0.0f, 1.0f, p, fv);
    EXPECT_EQ(st.code(), cl::errc::invalid_temperature) << s;
    EXPECT_EQ(st.argument(), "logit_scale") << s;
  }
  for (const float ls : {0.0f, -2.0f, INFINITY, NAN})
  {
    const cl::status st = fused(10.0f, 0.0f, ls, p, fv);
    EXPECT_EQ(st.code(), cl::errc::invalid_scaler) << ls;
    EXPECT_EQ(st.argument(), "loss_scale");
  }
  EXPECT_EQ(fused(10.0f, NAN, 1.0f, p, fv).argument(), "logit_bias");
  EXPECT_EQ(fused(10.0f, -10.0f, 1.0f, p, fv).argument(), "logit_bias"); // a softmax: b = 0 only
  EXPECT_EQ(fused(10.0f, 0.0f, 1.0f, p, nullptr).argument(), "d_values");
  cl::problem<float> sig = p;
  sig.obj = cl::objective::sigmoid;
  EXPECT_EQ(fused(10.0f, -10.0f, 1.0f, sig, fv).argument(), "obj"); // the sigmoid objective runs chunked
  cl::problem<float> no_dim = p;
  no_dim.dim = 0;
  EXPECT_EQ(fused(10.0f, 0.0f, 1.0f, no_dim, fv).argument(), "dim");

  const auto* hq = reinterpret_cast<const __half*>(dummy);
  auto* hd = reinterpret_cast<__half*>(dummy + 8);
  const cl::problem<__half> hp{hq, hq + 2, 2, 2, 2, nullptr, cl::objective::sigmoid};
  const auto h = reinterpret_cast<cublasHandle_t>(dummy);
  for (void* temp : {static_cast<void*>(nullptr), static_cast<void*>(fake)})
  {
    bytes = 1 << 20;
    EXPECT_EQ(C::step(temp, bytes, hp, 10.0f, -10.0f, 1.0f, hd, hd + 4, cv, cublasHandle_t{}).argument(), "handle");
    EXPECT_EQ(C::step(temp, bytes, hp, NAN, -10.0f, 1.0f, hd, hd + 4, cv, h).argument(), "logit_scale");
    EXPECT_EQ(C::step(temp, bytes, hp, 10.0f, -10.0f, 1.0f, hd, hd, cv, h).code(), cl::errc::invalid_argument);
    EXPECT_EQ(C::step(temp, bytes, hp, 10.0f, -10.0f, 1.0f, hd, hd + 4, nullptr, h).argument(), "d_values");
  }

  // The uploaded values: s itself (also where no float tau has 1/tau == s), b, the loss scale, an empty record.
  for (const float s : {10.0f, 14.2857141f, 100.0f, 3.0f, 7.0f, 1e-30f, 1e30f})
  {
    C::values_type v;
    ASSERT_TRUE(C::make_values(cl::objective::sigmoid, s, -10.0f, 4096.0f, v).ok()) << s;
    EXPECT_EQ(v.temperature.scale(), s);
    EXPECT_EQ(v.bias.value, -10.0f);
    EXPECT_TRUE(v.bias.is_learnable()); // so that a non-finite d loss / d b is diagnosed; no finish_step moves it
    EXPECT_EQ(v.scaler.loss_scale(), 4096.0f);
    EXPECT_EQ(v.step, 0);
  }
}

// device_scalars: s and b read from device memory give the host numbers' pass bit for bit; a value the host call
// refuses is reported by the step (NaN loss, site logits); a captured graph reads the values current at each replay.
TEST(DeviceCore, DeviceScalarsEqualHostNumbersAndReportBadValues)
{
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  using T = __nv_bfloat16;
  const std::size_t n_q = 300, dim = 64;
  handle h;
  ASSERT_NE(h.h, nullptr);
  auto check = [&](auto algorithm, cl::objective obj)
  {
    using A = decltype(algorithm);
    using C = dcore<T, A>;
    SCOPED_TRACE(std::string(A::name) + " " + cl::to_string(obj));
    const std::size_t n_k = obj == cl::objective::sigmoid ? 340 : n_q;
    device_inputs<T> in(n_q, n_k, dim, 9100 + static_cast<std::uint32_t>(obj));
    ASSERT_TRUE(in.ready());
    const cl::problem<T> p{in.d_q.ptr, in.d_k.ptr, n_q, n_k, dim, nullptr, obj};
    const float b = obj == cl::objective::sigmoid ? -10.0f : 0.0f;
    ct::device_buffer<float> d_s(1), d_b(1);
    ct::device_buffer<typename C::values_type> d_values(1);
    const cl::device::device_scalars from{d_s.ptr, obj == cl::objective::sigmoid ? d_b.ptr : nullptr};
    auto set = [&](float s)
    {
      EXPECT_EQ(cudaMemcpy(d_s.ptr, &s, sizeof s, cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(d_b.ptr, &b, sizeof b, cudaMemcpyHostToDevice), cudaSuccess);
    };
    auto read = [&]()
    {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      typename C::values_type v;
      EXPECT_EQ(cudaMemcpy(&v, d_values.ptr, sizeof v, cudaMemcpyDeviceToHost), cudaSuccess);
      return std::make_tuple(v.record, in.d_dq.download(), in.d_dk.download());
    };
    std::size_t bytes = 0;
    ASSERT_TRUE(C::step(nullptr, bytes, p, from, 256.0f, in.d_dq.ptr, in.d_dk.ptr, d_values.ptr, h.h).ok());
    ASSERT_GT(bytes, 0u); // the size query writes the bytes the pass needs
    ct::device_buffer<char> temp(bytes);
    for (const float s : {14.3f, 100.0f})
    {
      std::size_t host_bytes = 0;
      ASSERT_TRUE(C::step(nullptr, host_bytes, p, s, b, 256.0f, in.d_dq.ptr, in.d_dk.ptr, d_values.ptr, h.h).ok());
      ct::device_buffer<char> host_temp(host_bytes);
      ASSERT_TRUE(
          C::step(host_temp.ptr, host_bytes, p, s, b, 256.0f, in.d_dq.ptr, in.d_dk.ptr, d_values.ptr, h.h).ok());
      const auto [hr, hdq, hdk] = read();
      ASSERT_EQ(in.d_dq.poison(0xff), cudaSuccess);
      set(s);
      ASSERT_TRUE(C::step(temp.ptr, bytes, p, from, 256.0f, in.d_dq.ptr, in.d_dk.ptr, d_values.ptr, h.h).ok());
      const auto [dr, ddq, ddk] = read();
      EXPECT_EQ(dr.loss, hr.loss);
      EXPECT_EQ(dr.grad_logit_scale, hr.grad_logit_scale);
      EXPECT_EQ(dr.grad_logit_bias, hr.grad_logit_bias);
      EXPECT_EQ(0, std::memcmp(ddq.data(), hdq.data(), ddq.size() * sizeof(T)));
      EXPECT_EQ(0, std::memcmp(ddk.data(), hdk.data(), ddk.size() * sizeof(T)));
      EXPECT_EQ(dr.first_nonfinite, cl::nonfinite_site::none);
    }
    for (const float bad : {-1.0f, 0.0f, NAN, INFINITY})
    {
      set(bad);
      ASSERT_TRUE(C::step(temp.ptr, bytes, p, from, 256.0f, in.d_dq.ptr, in.d_dk.ptr, d_values.ptr, h.h).ok());
      const auto [r, dq, dk] = read();
      EXPECT_TRUE(std::isnan(r.loss)) << bad;
      EXPECT_EQ(r.first_nonfinite, cl::nonfinite_site::logits) << bad;
    }
    // A graph captured once reads the scale current at each replay.
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    cudaGraph_t g;
    cudaGraphExec_t ge;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    EXPECT_TRUE(C::step(temp.ptr, bytes, p, from, 256.0f, in.d_dq.ptr, in.d_dk.ptr, d_values.ptr, h.h, stream).ok());
    ASSERT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
    for (const float s : {14.3f, 100.0f})
    {
      set(s);
      ASSERT_EQ(cudaGraphLaunch(ge, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const auto [gr, gdq, gdk] = read();
      set(s);
      ASSERT_TRUE(C::step(temp.ptr, bytes, p, from, 256.0f, in.d_dq.ptr, in.d_dk.ptr, d_values.ptr, h.h).ok());
      const auto [er, edq, edk] = read();
      EXPECT_EQ(gr.loss, er.loss) << s;
      EXPECT_EQ(0, std::memcmp(gdq.data(), edq.data(), gdq.size() * sizeof(T)));
    }
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(stream);
  };
  check(cl::algorithm::automatic{}, cl::objective::symmetric);
  check(cl::algorithm::chunked{}, cl::objective::symmetric);
  check(cl::algorithm::chunked{}, cl::objective::sigmoid);
}

// device_scalars without a device: a null logit_scale pointer is refused, named, before any CUDA call.
TEST(DeviceCore, DeviceScalarsRefuseANullScale)
{
  using C = dcore<__nv_bfloat16, cl::algorithm::automatic>;
  alignas(16) unsigned char dummy[64] = {};
  const auto* q = reinterpret_cast<const __nv_bfloat16*>(dummy);
  auto* d = reinterpret_cast<__nv_bfloat16*>(dummy + 32);
  const cl::problem<__nv_bfloat16> p{q, q + 4, 2, 2, 2, nullptr, cl::objective::symmetric};
  std::size_t bytes = 0;
  const cl::status st = C::step(nullptr,
                                bytes,
                                p,
                                cl::device::device_scalars{},
                                1.0f,
                                d,
                                d + 4,
                                reinterpret_cast<C::values_type*>(dummy),
                                reinterpret_cast<cublasHandle_t>(dummy));
  EXPECT_EQ(st.code(), cl::errc::null_pointer);
  EXPECT_EQ(st.argument(), "logit_scale");
}
