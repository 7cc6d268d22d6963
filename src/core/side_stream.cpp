// SideStream in a build without the CUDA backend: nothing constructs one there (train/
// stream_gradient_buckets.cpp refuses first), but its holder's destructor names the
// destructor, so the CPU build defines the class's members, refusing any use.
#include "core/side_stream.h"

#include "core/error.h"

#if !KILN_WITH_CUDA
namespace kiln::cuda {

SideStream::SideStream(const ExecContext& main) : main_(main), side_(main) {
  fail("dist", "a side stream needs the CUDA backend");
}
SideStream::~SideStream() = default;
void SideStream::fork() { fail("dist", "a side stream needs the CUDA backend"); }
void SideStream::join() { fail("dist", "a side stream needs the CUDA backend"); }

}  // namespace kiln::cuda
#endif
