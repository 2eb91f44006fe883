// Built by tests/consumer/CMakeLists.txt: one half-precision CLIP step through the public header.
#include <contrastive/contrastive.hpp>

#include <cstdio>
#include <vector>

int main()
{
  const std::size_t n = 4, dim = 3;
  std::vector<__half> q(n * dim), k(n * dim), dq(n * dim), dk(n * dim);
  for (std::size_t i = 0; i < n * dim; ++i)
  {
    q[i] = __float2half_rn(0.1f * float(i % 5) - 0.2f);
    k[i] = __float2half_rn(0.05f * float(i % 7) - 0.1f);
  }
  contrastive::loss<__half, contrastive::temperature::clamped, contrastive::scaler::dynamic> loss(
      contrastive::temperature::clamped(0.07f, 0.01f, 1.0f), contrastive::scaler::dynamic::torch());
  contrastive::problem<__half> p{q.data(), k.data(), n, n, dim, nullptr, contrastive::objective::symmetric};
  contrastive::step_record rec;
  const contrastive::status st = loss.step(p, dq.data(), dk.data(), rec);
  std::printf("consumer: %s loss %.4f skipped %d\n", st.message().c_str(), rec.loss, int(rec.skipped));
  return st.ok() && !rec.skipped ? 0 : 1;
}
