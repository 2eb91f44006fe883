// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
// Data-parallel CLIP training over MPI with the global-batch loss, beside the same training in one process.
//
//   mpirun -np 4 ./build/examples/distributed_clip [--steps 60] [--batch 512] [--dim 64]
//
// A two-tower linear model (image and text projections, L2-normalised features) learns to match paired views of a
// shared latent. Every rank owns a slice of each global batch (unequal slices when the batch does not divide), gets
// the gradients of the *global* loss for its rows from contrastive::distributed::loss, back-propagates them into its
// weight gradients and all-reduces those (as DDP does). Rank 0 also trains an identical model on the whole batch
// with the one-process contrastive::loss and prints both loss curves side by side: they agree to float rounding.

#include <contrastive/comm/mpi.hpp>
#include <contrastive/contrastive.hpp>
#include <contrastive/distributed/loss.hpp>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace cl = contrastive;

namespace
{
struct options
{
  int steps = 60;
  std::size_t batch = 512; // global
  std::size_t dim = 64;    // feature width
  std::size_t in = 32;     // input width
  float lr = 2.0f;
};

/// Paired views of a shared latent for one step's global batch (identical on every rank: seeded by the step).
void make_batch(const options& o, int step, std::vector<float>& x, std::vector<float>& y)
{
  std::mt19937 rng(1000u + static_cast<unsigned>(step));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  x.resize(o.batch * o.in);
  y.resize(o.batch * o.in);
  for (std::size_t i = 0; i < o.batch; ++i)
  {
    for (std::size_t c = 0; c < o.in; ++c)
    {
      const float z = normal(rng);
      x[i * o.in + c] = z + 0.3f * normal(rng);
      y[i * o.in + c] = z + 0.3f * normal(rng);
    }
  }
}

/// One tower: features = normalize(W x); backward from d features to d W.
struct tower
{
  std::size_t dim, in;
  std::vector<float> w, grad;
  std::vector<float> raw_norm; // per row, saved for the backward

  tower(std::size_t d, std::size_t i, unsigned seed) : dim(d), in(i), w(d * i), grad(d * i)
  {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(float(i)));
    for (float& v : w)
    {
      v = normal(rng);
    }
  }

  void forward(const float* x, std::size_t rows, std::vector<float>& f)
  {
    f.assign(rows * dim, 0.0f);
    raw_norm.assign(rows, 0.0f);
    for (std::size_t r = 0; r < rows; ++r)
    {
      double n2 = 0.0;
      for (std::size_t o = 0; o < dim; ++o)
      {
        float acc = 0.0f;
        for (std::size_t c = 0; c < in; ++c)
        {
          acc += w[o * in + c] * x[r * in + c];
        }
        f[r * dim + o] = acc;
        n2 += double(acc) * acc;
      }
      raw_norm[r] = static_cast<float>(std::sqrt(n2));
      for (std::size_t o = 0; o < dim; ++o)
      {
        f[r * dim + o] /= raw_norm[r];
      }
    }
  }

  /// Accumulates d loss / d W from d loss / d features (f: the normalised features).
  void backward(const float* x, const std::vector<float>& f, const float* df, std::size_t rows)
  {
    std::fill(grad.begin(), grad.end(), 0.0f);
    std::vector<float> draw(dim);
    for (std::size_t r = 0; r < rows; ++r)
    {
      float dot = 0.0f;
      for (std::size_t o = 0; o < dim; ++o)
      {
        dot += f[r * dim + o] * df[r * dim + o];
      }
      for (std::size_t o = 0; o < dim; ++o)
      {
        draw[o] = (df[r * dim + o] - f[r * dim + o] * dot) / raw_norm[r];
      }
      for (std::size_t o = 0; o < dim; ++o)
      {
        for (std::size_t c = 0; c < in; ++c)
        {
          grad[o * in + c] += draw[o] * x[r * in + c];
        }
      }
    }
  }

  void update(float lr)
  {
    for (std::size_t i = 0; i < w.size(); ++i)
    {
      w[i] -= lr * grad[i];
    }
  }
};

using temperature_t = cl::temperature::learnable;
temperature_t make_temperature()
{
  return temperature_t(0.1f, cl::optimizer::adam(1e-2f));
}

bool parse(int argc, char** argv, options& o)
{
  for (int i = 1; i < argc; ++i)
  {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--steps" && has_value)
    {
      o.steps = std::atoi(argv[++i]);
    }
    else if (a == "--batch" && has_value)
    {
      o.batch = std::strtoul(argv[++i], nullptr, 10);
    }
    else if (a == "--dim" && has_value)
    {
      o.dim = std::strtoul(argv[++i], nullptr, 10);
    }
    else
    {
      return false;
    }
  }
  return o.steps > 0 && o.batch > 0 && o.dim > 0;
}
} // namespace

int main(int argc, char** argv)
{
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  options o;
  if (!parse(argc, argv, o) || o.batch < static_cast<std::size_t>(ranks))
  {
    if (rank == 0)
    {
      std::fprintf(stderr, "usage: mpirun -np R %s [--steps S] [--batch B >= R] [--dim D]\n", argv[0]);
    }
    MPI_Finalize();
    return 2;
  }
  // This rank's rows of every global batch (the first batch % ranks ranks hold one more).
  const std::size_t base = o.batch / ranks, extra = o.batch % ranks, r = static_cast<std::size_t>(rank);
  const std::size_t first = r * base + std::min(r, extra), rows = base + (r < extra ? 1 : 0);

  int rc = 0;
  {
    cl::distributed::
        loss<float, temperature_t, cl::scaler::static_scale, cl::algorithm::fused, cl::distributed::comm::mpi>
            dist(cl::distributed::comm::mpi(MPI_COMM_WORLD), make_temperature());
    tower img(o.dim, o.in, 7), txt(o.dim, o.in, 8);
    // Rank 0's reference: the same model and policies, trained on the whole batch in one process.
    cl::loss<float, temperature_t> one(make_temperature());
    tower img1(o.dim, o.in, 7), txt1(o.dim, o.in, 8);

    std::vector<float> x, y, q, k, dq, dk, q1, k1, dq1, dk1;
    double max_diff = 0.0;
    if (rank == 0)
    {
      std::printf(
          "data-parallel CLIP over %d ranks (global batch %zu, dim %zu) vs one process\n", ranks, o.batch, o.dim);
      std::printf("%5s %14s %14s %10s %10s\n", "step", "loss (ranks)", "loss (one)", "|diff|", "tau");
    }
    for (int step = 0; step < o.steps && rc == 0; ++step)
    {
      make_batch(o, step, x, y);
      const float* xs = x.data() + first * o.in;
      const float* ys = y.data() + first * o.in;
      img.forward(xs, rows, q);
      txt.forward(ys, rows, k);
      dq.resize(q.size());
      dk.resize(k.size());
      cl::step_record rec;
      const cl::status st = dist.step(
          {q.data(), k.data(), rows, rows, o.dim, nullptr, cl::objective::symmetric}, dq.data(), dk.data(), rec);
      if (!st)
      {
        std::fprintf(stderr, "rank %d: %s\n", rank, st.message().c_str());
        rc = 1;
        break;
      }
      img.backward(xs, q, dq.data(), rows);
      txt.backward(ys, k, dk.data(), rows);
      // dq/dk are gradients of the global loss: the weight gradients of all ranks add up (DDP's all-reduce).
      MPI_Allreduce(
          MPI_IN_PLACE, img.grad.data(), static_cast<int>(img.grad.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      MPI_Allreduce(
          MPI_IN_PLACE, txt.grad.data(), static_cast<int>(txt.grad.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      img.update(o.lr);
      txt.update(o.lr);

      if (rank == 0)
      {
        img1.forward(x.data(), o.batch, q1);
        txt1.forward(y.data(), o.batch, k1);
        dq1.resize(q1.size());
        dk1.resize(k1.size());
        cl::step_record rec1;
        if (!one.step({q1.data(), k1.data(), o.batch, o.batch, o.dim, nullptr, cl::objective::symmetric},
                      dq1.data(),
                      dk1.data(),
                      rec1))
        {
          rc = 1;
        }
        img1.backward(x.data(), q1, dq1.data(), o.batch);
        txt1.backward(y.data(), k1, dk1.data(), o.batch);
        img1.update(o.lr);
        txt1.update(o.lr);
        const double diff = std::fabs(double(rec.loss) - double(rec1.loss));
        max_diff = std::max(max_diff, diff / std::max(1e-30, std::fabs(double(rec1.loss))));
        if (step % 10 == 0 || step == o.steps - 1)
        {
          std::printf("%5d %14.7f %14.7f %10.2e %10.5f\n", step, rec.loss, rec1.loss, diff, rec.tau);
        }
      }
      MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
    }
    if (rank == 0 && rc == 0 && max_diff > 1e-5)
    {
      std::printf("FAILED: the distributed loss curve left the one-process curve (%.2e > 1e-5)\n", max_diff);
      rc = 3;
    }
    if (rank == 0 && rc == 0)
    {
      std::printf("largest relative difference of the two loss curves: %.2e (float rounding; the weights are\n"
                  "updated from all-reduced gradients in a different summation order)\n",
                  max_diff);
      std::printf(
          "per-rank memory of the loss: %zu bytes (rank 0, %zu of %zu rows)\n", dist.bytes_held(), rows, o.batch);
    }
  }
  MPI_Finalize();
  return rc;
}
