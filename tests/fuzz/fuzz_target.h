// What every fuzz target shares: a registration macro that makes the same target
// function a libFuzzer entry point (clang, scripts/fuzz.sh) or an entry in the table the
// corpus replay test walks (any compiler, ctest), and the policy on what counts as a bug.
//
// The policy: a target feeds its input to a parser; the parser may refuse it with a
// kiln::Error of one line ("[where] ..."). Anything else escaping (a nlohmann type_error,
// std::bad_alloc, std::out_of_range), an error of several lines, or a property the target
// checks afterwards failing is a bug: it is printed and the process aborts, so libFuzzer
// keeps the input as a crash and the replay test fails naming the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln::fuzz {

using TargetFn = void (*)(std::string_view input);

struct TargetRegistration {
  TargetRegistration(const char* name, TargetFn fn);
};
// nullptr when no target has that name.
TargetFn find_target(std::string_view name);

// Prints "kiln fuzz: bug: WHAT (DETAIL)" and the input's name, then aborts.
[[noreturn]] void bug(std::string_view what, std::string_view detail = {});
#define KILN_FUZZ_CHECK(cond, what) \
  do {                              \
    if (!(cond)) ::kiln::fuzz::bug(what, #cond); \
  } while (0)

// The name of the input being replayed, for bug() (the replay driver sets it).
void set_current_input(std::string name);

// Runs fn; a kiln::Error of one line is an accepted refusal, anything else is a bug().
// Returns true when fn returned normally.
template <typename Fn>
bool accepts(Fn&& fn);

// A file in this process's scratch directory (made on first use, removed at exit),
// holding `bytes`; returns its path. Writing the same name again replaces the file.
std::string scratch_file(const std::string& name, std::string_view bytes);
// The scratch directory itself.
const std::string& scratch_dir();

// Part `index` of the input cut at its NUL bytes ("" past the last): the JSON or TOML
// text a target parses comes first, extra files or override lines after. Those formats
// never hold a NUL, so mutations keep the parts apart.
std::string_view part(std::string_view input, size_t index);

// bug() unless `message` is one line in kiln's "[where] ..." form.
void check_one_line_error(const char* message);

}  // namespace kiln::fuzz

#include "core/error.h"

#include <exception>

template <typename Fn>
bool kiln::fuzz::accepts(Fn&& fn) {
  try {
    fn();
    return true;
  } catch (const kiln::Error& e) {
    check_one_line_error(e.what());
  } catch (const std::exception& e) {
    bug("an exception other than kiln::Error escaped", e.what());
  }
  return false;
}

#if defined(KILN_LIBFUZZER)
#define KILN_FUZZ_TARGET(name)                                                     \
  static void kiln_fuzz_##name(std::string_view input);                            \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {        \
    kiln_fuzz_##name(std::string_view(reinterpret_cast<const char*>(data), size)); \
    return 0;                                                                      \
  }                                                                                \
  static void kiln_fuzz_##name(std::string_view input)
#else
#define KILN_FUZZ_TARGET(name)                                                                        \
  static void kiln_fuzz_##name(std::string_view input);                                               \
  static const ::kiln::fuzz::TargetRegistration kiln_fuzz_registration_##name(#name, kiln_fuzz_##name); \
  static void kiln_fuzz_##name(std::string_view input)
#endif
