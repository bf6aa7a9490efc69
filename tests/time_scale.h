// kTimeScale: how many times longer a timed bound of a test may be in a
// sanitized build. ASan + UBSan run kvhost's code 2-5x slower, and CI runs
// two tests at once on two cores; a bound that guards a complexity (linear,
// not quadratic) or a stall (a second, not a minute) keeps its meaning at 4x.
#ifndef KVHOST_TESTS_TIME_SCALE_H_
#define KVHOST_TESTS_TIME_SCALE_H_

namespace kvhost::testing {

#if defined(KVHOST_SANITIZED)
inline constexpr int kTimeScale = 4;
#else
inline constexpr int kTimeScale = 1;
#endif

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_TIME_SCALE_H_
