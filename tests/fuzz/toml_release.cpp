// toml++'s parser for the fuzz build, compiled from its headers (so libFuzzer sees its
// branches and ASan/UBSan check it) but with NDEBUG, as Debian's libtomlplusplus that kiln
// links is built. Its debug assertions are not kiln's: toml++ 3.3.0 asserts a
// precondition that a table header such as "[=a]" breaks, where the release library
// returns a parse error (fixed upstream in marzer/tomlplusplus#301; docs/reliability.md).
// CMakeLists.txt also turns UBSan's unreachable check off for this file: toml++ 3.3.0
// reaches its TOML_UNREACHABLE for some non-ASCII characters (#295, fixed by #305).
#define NDEBUG
#define TOML_IMPLEMENTATION
#if __has_include(<toml++/toml.hpp>)
#include <toml++/toml.hpp>
#else
#include <toml++/toml.h>
#endif
