#include <gtest/gtest.h>
#include "collapse_demo.hpp"
TEST(Demo, Placeholder) {}
