// Seeded random driver for fuzz_loss.cpp where libFuzzer is not used: feeds pseudo-random inputs of random lengths.
// Usage: fuzz_driver [iterations = 2000] [seed = 1]. Deterministic for a given seed; prints one summary line.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

int main(int argc, char** argv)
{
  const long iterations = argc > 1 ? std::atol(argv[1]) : 2000;
  const unsigned long seed = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 1;
  std::mt19937_64 rng(seed);
  std::vector<std::uint8_t> input;
  for (long i = 0; i < iterations; ++i)
  {
    input.resize(static_cast<std::size_t>(rng() % 4096));
    for (auto& b : input)
    {
      b = static_cast<std::uint8_t>(rng());
    }
    LLVMFuzzerTestOneInput(input.data(), input.size());
  }
  std::printf("fuzz_driver: %ld random inputs (seed %lu), no violation\n", iterations, seed);
  return 0;
}
