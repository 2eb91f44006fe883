// The README's API tour, compiled: one CLIP training step on random features, then a timing of the fused host path.
//
//   ./build/examples/quickstart [n] [dim]     (default n = 4096, dim = 512)

#include <contrastive/contrastive.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv)
{
  const std::size_t n = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 4096;
  const std::size_t dim = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 512;

  // Image and text features (here random, L2-normalised as CLIP's are).
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(n * dim), k(n * dim), dq(n * dim), dk(n * dim);
  for (std::size_t i = 0; i < n; ++i)
  {
    for (float* row : {&q[i * dim], &k[i * dim]})
    {
      float norm = 0.0f;
      for (std::size_t c = 0; c < dim; ++c)
      {
        row[c] = normal(rng);
        norm += row[c] * row[c];
      }
      for (std::size_t c = 0; c < dim; ++c)
      {
        row[c] /= std::sqrt(norm);
      }
    }
  }

  // Element type x temperature policy x scaler policy x algorithm, chosen at compile time.
  using clip_loss = contrastive::
      loss<float, contrastive::temperature::clamped, contrastive::scaler::dynamic, contrastive::algorithm::fused>;
  clip_loss loss(contrastive::temperature::clamped(/*initial tau*/ 0.07f, /*tau_min*/ 0.01f, /*tau_max*/ 1.0f),
                 contrastive::scaler::dynamic::torch());

  contrastive::problem<float> p;
  p.q = q.data();
  p.k = k.data();
  p.n_q = p.n_k = n;
  p.dim = dim;
  p.obj = contrastive::objective::symmetric;

  contrastive::step_record rec;
  const auto t0 = std::chrono::steady_clock::now();
  const contrastive::status st = loss.step(p, dq.data(), dk.data(), rec);
  const auto t1 = std::chrono::steady_clock::now();
  if (!st)
  {
    std::fprintf(stderr, "step failed: %s\n", st.message().c_str());
    return 1;
  }
  const double seconds = std::chrono::duration<double>(t1 - t0).count();
  std::printf("n = %zu, dim = %zu, float, fused, %u threads\n", n, dim, loss.threads());
  std::printf("loss %.6f  tau %.5f -> %.5f  loss scale %.0f -> %.0f  skipped %s (first non-finite: %s)\n",
              rec.loss,
              rec.tau,
              loss.tau(),
              rec.loss_scale,
              rec.next_loss_scale,
              rec.skipped ? "yes" : "no",
              contrastive::to_string(rec.first_nonfinite));
  std::printf("forward+backward: %.3f s, %.1f GFLOP/s counting 8 n^2 d\n",
              seconds,
              8.0 * double(n) * double(n) * double(dim) / seconds * 1e-9);
  return 0;
}
