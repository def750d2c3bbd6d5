// Incremental reloads: load_store(path, target, previous) and load_memory(.., previous) read only
// the facts `previous` does not hold with the file's bytes.
//
// Expectations are never taken from the incremental path itself:
//  - every incremental load is compared with a full load of the same file (load_store(path,
//    target) / load_memory(directory, config)): records, namespace order, free-page stack, the
//    whole pool (free pages included), and the bytes a re-save writes — over commit sequences that
//    add, erase, re-insert an id with other tokens or other bytes, re-encode facts in place
//    (update_turns), set the instruction prefix, empty a namespace, and convert dtypes;
//  - that unchanged facts are not read is shown by damage: a byte flipped in an unchanged fact's
//    pages is refused by the full load and not seen by the incremental one (whose result equals
//    the full load of the undamaged file), while a byte flipped in a fact it must read is refused,
//    naming the file and the fact;
//  - files are edited through the documented layout (snapshot_common.hpp, reference CRC-64).
#include "fake_model.hpp"
#include "memory_fixtures.hpp"
#include "snapshot_common.hpp"

#include <inferscale/detail/snapshot/store_access.hpp>
#include <inferscale/error.hpp>
#include <inferscale/memory.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/store.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

using namespace inferscale;
using namespace inferscale_test::fake;
using namespace inferscale_test::memory_fixtures;
using namespace inferscale_test::snapshot;
using Catch::Matchers::Contains;

namespace {

using access = inferscale::detail::store_access;

/// Every observable of two stores, and the bytes a save of each writes.
void check_same_store(kv_store const& a, kv_store const& b, scratch_dir const& dir)
{
  CHECK(a.store_dtype() == b.store_dtype());
  CHECK(a.num_pages() == b.num_pages());
  CHECK(a.num_facts() == b.num_facts());
  REQUIRE(access::namespace_ids(a) == access::namespace_ids(b));
  for (std::uint64_t ns : access::namespace_ids(a)) {
    REQUIRE(a.namespace_fact_ids(ns) == b.namespace_fact_ids(ns));
    for (std::uint64_t id : a.namespace_fact_ids(ns)) {
      CAPTURE(id);
      CHECK(a.at(id).namespace_id == b.at(id).namespace_id);
      CHECK(a.at(id).token_ids == b.at(id).token_ids);
      CHECK(a.at(id).pages == b.at(id).pages);
    }
  }
  CHECK(access::free_stack(a) == access::free_stack(b));
  CHECK(a.pool_to_host() == b.pool_to_host());  // every page, the free ones' zeros too
  save_store(a, dir.file("resave-a.iskv"));
  save_store(b, dir.file("resave-b.iskv"));
  CHECK(read_bytes(dir.file("resave-a.iskv")) == read_bytes(dir.file("resave-b.iskv")));
}

std::string store_error(std::function<void()> const& load)
{
  try {
    load();
  } catch (logic_error const& e) {
    return e.what();
  }
  return {};
}

/// File offset of the first byte of page `page` (in use) of `store` saved to a file.
std::size_t page_offset(std::vector<unsigned char> const& file,
                        kv_store const& store,
                        std::int64_t page)
{
  std::vector<std::int64_t> used;
  for (std::uint64_t ns : access::namespace_ids(store)) {
    for (std::uint64_t id : store.namespace_fact_ids(ns)) {
      used.insert(used.end(), store.at(id).pages.begin(), store.at(id).pages.end());
    }
  }
  std::sort(used.begin(), used.end());
  layout const l      = layout_of(file);
  std::size_t const B = (file.size() - l.pool_begin() - 8) / used.size();
  auto const rank     = std::lower_bound(used.begin(), used.end(), page) - used.begin();
  return l.pool_begin() + static_cast<std::size_t>(rank) * B;
}

struct dtypes {
  dtype file, target, previous;
};

}  // namespace

TEST_CASE("snapshot reload: an incremental load equals a full load", "[snapshot][reload]")
{
  dtypes const d = GENERATE(dtypes{dtype::bfloat16, dtype::bfloat16, dtype::bfloat16},
                            dtypes{dtype::float32, dtype::float32, dtype::float32},
                            dtypes{dtype::bfloat16, dtype::float32, dtype::float32},
                            dtypes{dtype::float32, dtype::bfloat16, dtype::bfloat16},
                            dtypes{dtype::float16, dtype::bfloat16, dtype::float32},
                            dtypes{dtype::bfloat16, dtype::bfloat16, dtype::float32},
                            dtypes{dtype::float32, dtype::float16, dtype::float32});
  CAPTURE(to_string(d.file), to_string(d.target), to_string(d.previous));
  scratch_dir dir;
  std::string const path          = dir.file("store.iskv");
  kv_store_config const target    = shard_config(d.target, 16);
  kv_store_config const prev_like = shard_config(d.previous, 16);
  kv_store writer                 = scrambled_store(d.file);
  save_store(writer, path);
  std::optional<kv_store> previous;  // the reader's generation, in its own dtype
  previous.emplace(load_store(path, prev_like));

  std::vector<float> const other_values{0.5f, -1.25f, 2.0f};
  std::vector<std::function<void()>> const commits{
    [&] { insert_fact(writer, 20, 2, 7); },  // a new fact (2 pages)
    [&] { writer.erase(12); },               // an erasure (3 pages back on the stack)
    [&] {  // same id and tokens, other bytes: `previous` must not lend them
      writer.erase(14);
      insert_fact(writer, 14, 2, 4, &other_values);
    },
    [&] {  // same id, other tokens
      writer.erase(15);
      insert_fact(writer, 15, 1, 5);
    },
    [&] {  // a namespace emptied, two facts added
      (void)writer.erase_namespace(2);
      insert_fact(writer, 30, 4, 9);
      insert_fact(writer, 31, 1, 1);
    },
    [] {},  // nothing changed
  };
  for (std::size_t step = 0; step < commits.size(); ++step) {
    CAPTURE(step);
    commits[step]();
    save_store(writer, path);
    kv_store const full        = load_store(path, target);
    kv_store const incremental = load_store(path, target, *previous);
    check_same_store(full, incremental, dir);
    // the reader's own dtype: its next previous, loaded incrementally from the last one
    kv_store next = load_store(path, prev_like, *previous);
    check_same_store(load_store(path, prev_like), next, dir);
    previous.emplace(std::move(next));
  }
}

TEST_CASE("snapshot reload: a previous of another layout or memory only costs reads",
          "[snapshot][reload]")
{
  scratch_dir dir;
  std::string const path       = dir.file("store.iskv");
  kv_store_config const target = shard_config(dtype::float32, 16);
  kv_store const writer        = scrambled_store(dtype::float32);
  save_store(writer, path);
  kv_store const full = load_store(path, target);

  // same ids, other contents: every fact is read
  kv_store stranger{shard_config(dtype::float32, 16)};
  std::vector<float> const other_values{1.0f, 2.0f};
  for (std::uint64_t id : scrambled_ids) {
    std::int32_t const length = writer.at(id).length();
    insert_fact(stranger, id, writer.at(id).namespace_id, length, &other_values);
  }
  check_same_store(full, load_store(path, target, stranger), dir);

  // another page size or shard: not a source at all
  kv_store_config other_pages = shard_config(dtype::float32, 32);
  other_pages.page_size       = 2;
  kv_store const small_pages{other_pages};
  check_same_store(full, load_store(path, target, small_pages), dir);
  kv_store_config other_shard = shard_config(dtype::float32, 16);
  other_shard.first_head      = 0;
  kv_store const other{other_shard};
  check_same_store(full, load_store(path, target, other), dir);
}

TEST_CASE("snapshot reload: only what changed is read, and what is read is checked",
          "[snapshot][reload]")
{
  scratch_dir dir;
  std::string const path       = dir.file("store.iskv");
  kv_store_config const target = shard_config(dtype::float32, 16);
  kv_store writer              = scrambled_store(dtype::float32);
  save_store(writer, path);
  kv_store const previous = load_store(path, target);
  insert_fact(writer, 20, 2, 7);
  save_store(writer, path);
  std::vector<unsigned char> const good = read_bytes(path);
  kv_store const full                   = load_store(path, target);

  // a flipped byte in an unchanged fact's pages: the full load refuses the file; the incremental
  // load never reads those bytes and gives the full load of the undamaged file
  std::string const damaged    = dir.file("damaged.iskv");
  std::vector<unsigned char> f = good;
  f[page_offset(good, writer, writer.at(12).pages[1]) + 5] ^= 0x10;
  write_bytes(damaged, f);
  CHECK_THAT(store_error([&] { (void)load_store(damaged, target); }),
             Contains(damaged) && Contains("checksum mismatch"));
  check_same_store(full, load_store(damaged, target, previous), dir);

  // a flipped byte in the new fact's pages: refused, naming the file and the fact
  f = good;
  f[page_offset(good, writer, writer.at(20).pages[1]) + 3] ^= 0x01;
  write_bytes(damaged, f);
  CHECK_THAT(store_error([&] { (void)load_store(damaged, target, previous); }),
             Contains(damaged) && Contains("fact 20: checksum mismatch of its pages"));

  // a fact table entry that disagrees with the pages (a writer's error: the file checksum holds)
  // is refused by both loads; an unchanged fact's entry too, since `previous` cannot match it
  for (std::uint64_t id : {std::uint64_t{20}, std::uint64_t{12}}) {
    CAPTURE(id);
    f = good;
    refresh_checksums(f);
    REQUIRE(f == good);  // the reference layout and CRCs agree with the writer
    layout const l      = layout_of(f);
    std::size_t ordinal = 0;  // catalogue order: namespaces ascending, insertion order
    for (std::uint64_t ns : access::namespace_ids(writer)) {
      std::vector<std::uint64_t> const ids = writer.namespace_fact_ids(ns);
      auto const it                        = std::find(ids.begin(), ids.end(), id);
      if (it != ids.end()) {
        ordinal += static_cast<std::size_t>(it - ids.begin());
        break;
      }
      ordinal += ids.size();
    }
    std::size_t const entry = l.fact_table_begin() + 8 * ordinal;
    set(f, entry, get<std::uint64_t>(f, entry) ^ 1u);
    set(f, l.catalogue_end(), reference_crc64(f.data() + 104, l.catalogue_end() - 104));
    set(f, f.size() - 8, reference_file_checksum(f));
    write_bytes(damaged, f);
    std::string const message = "fact " + std::to_string(id) + ": checksum mismatch of its pages";
    CHECK_THAT(store_error([&] { (void)load_store(damaged, target); }),
               Contains(damaged) && Contains(message));
    CHECK_THAT(store_error([&] { (void)load_store(damaged, target, previous); }),
               Contains(damaged) && Contains(message));
  }

  // damage the catalogue or the header: refused before anything is read, as by the full load
  f = good;
  f[110] ^= 0x01;
  write_bytes(damaged, f);
  CHECK_THAT(store_error([&] { (void)load_store(damaged, target, previous); }),
             Contains(damaged) && Contains("catalogue checksum mismatch"));
  f = good;
  f.resize(f.size() - 1);
  write_bytes(damaged, f);
  CHECK_THAT(store_error([&] { (void)load_store(damaged, target, previous); }),
             Contains(damaged) && Contains("truncated"));
}

TEST_CASE("snapshot reload: a version-1 file still loads, and is read whole", "[snapshot][reload]")
{
  scratch_dir dir;
  std::string const path       = dir.file("store.iskv");
  std::string const path_v1    = dir.file("store-v1.iskv");
  kv_store_config const target = shard_config(dtype::bfloat16, 16);
  kv_store const writer        = scrambled_store(dtype::bfloat16);
  save_store(writer, path);
  std::vector<unsigned char> const v2 = read_bytes(path);
  std::vector<unsigned char> const v1 = to_version_1(v2);
  REQUIRE(get<std::uint32_t>(v1, 8) == 1);
  REQUIRE(v1.size() == v2.size() - 8 * scrambled_ids.size());
  write_bytes(path_v1, v1);
  kv_store const full = load_store(path, target);
  check_same_store(full, load_store(path_v1, target), dir);  // a re-save writes version 2
  check_same_store(full, load_store(path_v1, target, full), dir);
  // with no fact table the incremental load reads everything: damage anywhere is seen
  std::vector<unsigned char> f = v1;
  f[page_offset(v1, writer, writer.at(12).pages[0]) + 1] ^= 0x04;
  write_bytes(path_v1, f);
  CHECK_THAT(store_error([&] { (void)load_store(path_v1, target, full); }),
             Contains(path_v1) && Contains("checksum mismatch"));
}

namespace {

/// Two memories are the same: the same application data, the same files when saved (names and
/// bytes: store, index, lifecycle, application, manifest), the same pool (free pages included).
void check_same_memory(memory const& a, memory const& b, scratch_dir const& dir)
{
  std::string const da = dir.file("resave-a"), db = dir.file("resave-b");
  fs::remove_all(da);
  fs::remove_all(db);
  fs::create_directories(da);
  fs::create_directories(db);
  save_memory(a, da, std::string{"app"});
  save_memory(b, db, std::string{"app"});
  std::set<std::string> na, nb;
  for (auto const& e : fs::directory_iterator(da)) {
    na.insert(e.path().filename().string());
  }
  for (auto const& e : fs::directory_iterator(db)) {
    nb.insert(e.path().filename().string());
  }
  REQUIRE(na == nb);
  for (std::string const& name : na) {
    CAPTURE(name);
    CHECK(read_bytes(da + "/" + name) == read_bytes(db + "/" + name));
  }
  CHECK(a.store().pool_to_host() == b.store().pool_to_host());
  CHECK(access::free_stack(a.store()) == access::free_stack(b.store()));
  CHECK(a.instruction_prefix() == b.instruction_prefix());
}

}  // namespace

TEST_CASE("memory snapshot reload: load_memory from the previous generation equals a full load",
          "[snapshot][memory][reload]")
{
  dtype const reader_dtype = GENERATE(dtype::bfloat16, dtype::float32);  // files are bfloat16
  CAPTURE(to_string(reader_dtype));
  scratch_dir dir;
  memory_config const config = tiny_memory_config(dtype::bfloat16, 256);
  memory_config const reader = tiny_memory_config(reader_dtype, 256);
  memory m{config};
  branching_model model;
  word_embedder embedder;
  user_data const a = make_user(7, 100, 12, 5);
  user_data const b = make_user(8, 200, 9, 5);
  encoding_options o;
  o.window = 3;
  std::uint64_t const conv =
    m.add_conversation(model, embedder, 7, a.c, a.facts, a.texts, o).conversation;
  save_memory(m, dir.path(), std::string{"generation 1"});
  std::optional<memory> previous;
  previous.emplace(load_memory(dir.path(), reader));

  std::vector<std::function<void()>> const commits{
    [&] { (void)m.add_conversation(model, embedder, 8, b.c, b.facts, b.texts, o); },
    [&] { m.erase_fact(105); },
    [&] {  // facts re-encoded in place: same ids, tokens and pages, other bytes
      REQUIRE_FALSE(m.facts_seeing_turn(conv, 3).empty());
      (void)m.update_turns(model, conv, {{3, {3000, 3007, 3014, 3021}}});
    },
    [&] {
      m.set_instruction_prefix(model, {11, 12, 13}, 1, 0);
    },
    [&] { (void)m.erase_namespace(8); },
  };
  for (std::size_t step = 0; step < commits.size(); ++step) {
    CAPTURE(step);
    commits[step]();
    std::string const data = "generation " + std::to_string(step + 2);
    save_memory(m, dir.path(), data);
    std::optional<std::string> full_data, incremental_data;
    memory const full  = load_memory(dir.path(), reader, &full_data);
    memory incremental = load_memory(dir.path(), reader, &incremental_data, &*previous);
    CHECK(full_data == std::optional<std::string>{data});
    CHECK(incremental_data == full_data);
    check_same_memory(full, incremental, dir);
    previous.emplace(std::move(incremental));
  }
  // null previous: the full load
  check_same_memory(
    load_memory(dir.path(), reader, nullptr, nullptr), load_memory(dir.path(), reader), dir);
}

TEST_CASE("snapshot reload: a file without facts allocates nothing for any page size",
          "[snapshot][reload]")
{
  // Found by tests/fuzz: a loadable file with no pages whose header states pages of 2^30 tokens
  // of head_dim 2^20 (2^55 bytes each) made the incremental load allocate a one-page buffer.
  scratch_dir dir;
  std::string const path = dir.file("empty.iskv");
  kv_store_config c      = shard_config(dtype::float32, 0);
  save_store(kv_store{c}, path);
  std::vector<unsigned char> f = read_bytes(path);
  set(f, 24, std::int32_t{1} << 20);  // head_dim
  set(f, 44, std::int32_t{1} << 30);  // page_size
  refresh_checksums(f);
  write_bytes(path, f);
  c.model.head_dim = 1 << 20;
  c.page_size      = 1 << 30;
  kv_store const previous{c};  // the same page layout, no pages
  kv_store const full        = load_store(path, c);
  kv_store const incremental = load_store(path, c, previous);
  CHECK(incremental.num_facts() == 0);
  CHECK(incremental.num_pages() == full.num_pages());
}
