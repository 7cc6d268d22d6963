// Fuzz target: read_manifest, the manifest.json of a kiln shard directory (data.path of
// any run on `kiln tokenize` output). A manifest that reads must round-trip:
// write_manifest() of it reads back to the same splits, counts and hashes.
#include "../fuzz_target.h"

#include "data/shards/manifest.h"

namespace {

bool same_split(const kiln::ManifestSplit& a, const kiln::ManifestSplit& b) {
  if (a.documents != b.documents || a.tokens != b.tokens || a.shards.size() != b.shards.size()) return false;
  for (size_t i = 0; i < a.shards.size(); ++i) {
    const auto &x = a.shards[i], &y = b.shards[i];
    if (x.file != y.file || x.documents != y.documents || x.tokens != y.tokens || x.hash != y.hash) return false;
  }
  return true;
}

}  // namespace

KILN_FUZZ_TARGET(manifest) {
  using namespace kiln;
  const std::string path = fuzz::scratch_file("manifest.json", input);
  Manifest m;
  if (!fuzz::accepts([&] { m = read_manifest(path); })) return;
  const std::string again = fuzz::scratch_dir() + "/again.json";
  write_manifest(again, m);
  Manifest back;
  if (!fuzz::accepts([&] { back = read_manifest(again); })) fuzz::bug("a written manifest does not read back");
  KILN_FUZZ_CHECK(same_split(m.train, back.train) && same_split(m.validation, back.validation) &&
                      m.vocab_size == back.vocab_size && m.tokenizer_hash == back.tokenizer_hash &&
                      m.token_bytes == back.token_bytes && m.fingerprint == back.fingerprint &&
                      m.bos_id == back.bos_id && m.skipped.counts == back.skipped.counts,
                  "a written manifest reads back different values");
}
