// Crash-safe file primitives for checkpoints: data is on disk (fsync) before anything
// points at it, and names change only by rename(2), which is atomic on POSIX file
// systems. Errors are one line: "[where] PATH: what failed: strerror".
#pragma once

#include <string>
#include <string_view>

namespace kiln::io {

// Creates (truncates) `path`, writes `bytes`, fsyncs and closes it. A short write,
// ENOSPC, EFBIG or EIO throws; the partial file is left for the caller to clean up.
void write_file_synced(const std::string& path, std::string_view bytes, std::string_view where);
// fsync of a file or a directory (a directory's fsync makes its entries - new files,
// renames - durable).
void fsync_path(const std::string& path, std::string_view where);
// rename(2) then fsync of the destination's directory.
void rename_synced(const std::string& from, const std::string& to, std::string_view where);
// Replaces `path` atomically: PATH.tmp written and synced, renamed over PATH, directory
// synced. Readers see the old or the new content, never a mix.
void replace_file_atomically(const std::string& path, std::string_view bytes, std::string_view where);
// Creates `dir` (and parents) and proves a file can be created in it; throws
// "[key] DIR: cannot create: ..." or "[key] DIR: not writable: ..." otherwise.
void ensure_writable_dir(const std::string& dir, std::string_view key);
// The whole file as bytes; throws "[where] PATH: cannot read: ..." if it cannot be read.
std::string read_file_bytes(const std::string& path, std::string_view where);

}  // namespace kiln::io
