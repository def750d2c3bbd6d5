// The directory transaction under save_tiers and save_memory
// (detail/snapshot/directory_transaction.hpp): a commit replaces the manifest and removes the
// previous files the new snapshot does not reuse; a failure before the commit point (a failing
// write, a failing rename, a manifest that cannot be written) leaves the directory exactly as it
// was; a commit removes what killed saves left behind (and nothing else); a load's check of the
// named files refuses a file of another save.
//
// Expectations are the test's own: the directory's starting contents are literal strings written
// here, and after each scenario the file names and bytes are compared with those literals.
#include "snapshot_common.hpp"

#include <inferscale/detail/snapshot/directory_transaction.hpp>
#include <inferscale/error.hpp>

#include <catch2/catch.hpp>

#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

using namespace inferscale_test::snapshot;
using Catch::Matchers::Contains;
using inferscale::logic_error;
using inferscale::detail::snapshot::check_named_files;
using inferscale::detail::snapshot::directory_transaction;
using inferscale::detail::snapshot::named_file;
using inferscale::detail::snapshot::previous_manifest;

namespace {

std::vector<unsigned char> bytes_of(std::string const& text) { return {text.begin(), text.end()}; }

/// Every regular file of the directory and its contents ("<dir>" for a directory).
std::map<std::string, std::string> contents(std::string const& directory)
{
  std::map<std::string, std::string> files;
  for (auto const& entry : fs::directory_iterator(directory)) {
    std::string const name = entry.path().filename().string();
    if (entry.is_directory()) {
      files[name] = "<dir>";
    } else {
      std::vector<unsigned char> const b = read_bytes(entry.path().string());
      files[name]                        = std::string(b.begin(), b.end());
    }
  }
  return files;
}

/// The previous snapshot: a manifest naming a-1 and b-1, and a file no snapshot names.
std::map<std::string, std::string> const& old_snapshot()
{
  static std::map<std::string, std::string> const files{
    {"manifest", "old manifest"}, {"a-1", "A one"}, {"b-1", "B one"}, {"stray", "not ours"}};
  return files;
}

void write_old_snapshot(scratch_dir const& dir)
{
  for (auto const& [name, text] : old_snapshot()) {
    write_bytes(dir.file(name), bytes_of(text));
  }
}

/// A stage writer: the file, whole.
auto writes(std::string const& text)
{
  return [text](std::string const& path) { write_bytes(path, bytes_of(text)); };
}

}  // namespace

TEST_CASE("directory transaction: a commit replaces the manifest, keeps reused files",
          "[snapshot][directory]")
{
  scratch_dir dir;
  write_old_snapshot(dir);
  {
    directory_transaction tx{dir.path(), "test_save", {"a-1", "b-1"}};
    std::string const a = tx.stage("a.pending", writes("A two"));
    std::string const b = tx.stage("b.pending", writes("B one"));  // unchanged contents
    CHECK(a == dir.file("a.pending"));
    tx.place(a, "a-2");
    tx.place(b, "b-1");
    CHECK_FALSE(tx.committed());
    tx.commit("manifest", bytes_of("new manifest"));
    CHECK(tx.committed());
  }
  std::map<std::string, std::string> const want{
    {"manifest", "new manifest"}, {"a-2", "A two"}, {"b-1", "B one"}, {"stray", "not ours"}};
  CHECK(contents(dir.path()) == want);
}

TEST_CASE("directory transaction: a failure before the commit leaves the directory as it was",
          "[snapshot][directory]")
{
  scratch_dir dir;
  write_old_snapshot(dir);

  SECTION("a write throws after an earlier file was staged and placed")
  {
    {
      directory_transaction tx{dir.path(), "test_save", {"a-1", "b-1"}};
      tx.place(tx.stage("a.pending", writes("A two")), "a-2");
      // the same contents under a previous file's name (as a real save reuses an unchanged
      // file): the rollback must not remove it
      tx.place(tx.stage("b.pending", writes("B one")), "b-1");
      CHECK_THROWS_WITH(tx.stage("c.pending",
                                 [](std::string const& path) {
                                   write_bytes(path, bytes_of("half"));
                                   throw std::runtime_error("disk full");
                                 }),
                        "disk full");
    }
    CHECK(contents(dir.path()) == old_snapshot());
  }
  SECTION("the system refuses a write (checksummed_writer cannot create the file)")
  {
    fs::create_directory(dir.file("a.pending.tmp"));
    {
      directory_transaction tx{dir.path(), "test_save", {"a-1", "b-1"}};
      tx.place(tx.stage("b.pending", writes("B two")), "b-2");
      CHECK_THROWS_WITH(
        tx.stage("a.pending",
                 [&](std::string const& path) {
                   (void)inferscale::detail::serial::write_file_atomically(
                     path, "test_save", false, [](auto& out) { out.write("A two", 5); });
                 }),
        Contains("test_save") && Contains("cannot create") && Contains("a.pending.tmp"));
    }
    std::map<std::string, std::string> want = old_snapshot();
    want["a.pending.tmp"]                   = "<dir>";
    CHECK(contents(dir.path()) == want);
  }
  SECTION("a rename fails (the final name is a non-empty directory)")
  {
    fs::create_directory(dir.file("a-2"));
    write_bytes(dir.file("a-2") + "/inside", bytes_of("x"));
    {
      directory_transaction tx{dir.path(), "test_save", {"a-1", "b-1"}};
      std::string const a = tx.stage("a.pending", writes("A two"));
      CHECK_THROWS_WITH(tx.place(a, "a-2"), Contains("cannot rename") && Contains("a.pending"));
    }
    std::map<std::string, std::string> want = old_snapshot();
    want["a-2"]                             = "<dir>";
    CHECK(contents(dir.path()) == want);
  }
  SECTION("the manifest cannot be written: the commit fails, the old snapshot stays")
  {
    fs::create_directory(dir.file("manifest.tmp"));
    {
      directory_transaction tx{dir.path(), "test_save", {"a-1", "b-1"}};
      tx.place(tx.stage("a.pending", writes("A two")), "a-2");
      tx.place(tx.stage("b.pending", writes("B one")), "b-1");
      CHECK_THROWS_WITH(tx.commit("manifest", bytes_of("new manifest")),
                        Contains("cannot create") && Contains("manifest.tmp"));
      CHECK_FALSE(tx.committed());
    }
    std::map<std::string, std::string> want = old_snapshot();
    want["manifest.tmp"]                    = "<dir>";
    CHECK(contents(dir.path()) == want);
  }
  SECTION("a missing directory: the first write names it, nothing is created")
  {
    directory_transaction tx{dir.file("nowhere"), "test_save", {}};
    CHECK_THROWS_WITH(tx.stage("a.pending",
                               [&](std::string const& path) {
                                 (void)inferscale::detail::serial::write_file_atomically(
                                   path, "test_save", false, [](auto& out) { out.write("A", 1); });
                               }),
                      Contains("cannot create") && Contains("nowhere"));
    CHECK_FALSE(fs::exists(dir.file("nowhere")));
    CHECK(contents(dir.path()) == old_snapshot());
  }
}

TEST_CASE("directory transaction: a commit removes what killed saves left behind",
          "[snapshot][directory]")
{
  // A save killed outright runs no destructor: here one killed while staging (a pending file and
  // a temporary), one killed after placing a file and writing the manifest's temporary, and one
  // killed after its commit point (the snapshot before the previous one still there). Files
  // named like the snapshot's own but not quite, files of other names and a directory are not its
  // own: they stay.
  scratch_dir dir;
  write_old_snapshot(dir);
  std::string const h1 = "0123456789abcdef", h2 = "fedcba9876543210";
  std::map<std::string, std::string> const killed{{"a.pending", "half of A"},
                                                  {"b.pending.tmp", "half of B"},
                                                  {"a-" + h1, "A of a killed save"},
                                                  {"b-" + h1 + "-" + h2, "B of a killed save"},
                                                  {"manifest.tmp", "half a manifest"},
                                                  {"a-" + h2, "A before the previous snapshot"}};
  std::map<std::string, std::string> const not_ours{{"a-0123456789ABCDEF", "upper case"},
                                                    {"a-0123456789abcde", "15 digits"},
                                                    {"a-" + h1 + "-", "a dangling dash"},
                                                    {"a-" + h1 + ".bak", "another extension"},
                                                    {"c-" + h1, "a stem this save does not stage"},
                                                    {"xa-" + h1, "a longer stem"}};
  for (auto const* files : {&killed, &not_ours}) {
    for (auto const& [name, text] : *files) {
      write_bytes(dir.file(name), bytes_of(text));
    }
  }
  fs::create_directory(dir.file("b-" + h2));  // named like a leftover, but not a regular file
  {
    directory_transaction tx{dir.path(), "test_save", {"a-1", "b-1"}};
    tx.place(tx.stage("a.pending", writes("A two")), "a-" + h2);  // reuses a leftover's name
    tx.place(tx.stage("b.pending", writes("B two")), "b-2");
    tx.commit("manifest", bytes_of("new manifest"));
  }
  std::map<std::string, std::string> want = not_ours;
  want["manifest"]                        = "new manifest";
  want["a-" + h2]                         = "A two";
  want["b-2"]                             = "B two";
  want["stray"]                           = "not ours";
  want["b-" + h2]                         = "<dir>";
  CHECK(contents(dir.path()) == want);
}

TEST_CASE("directory transaction: misuse is refused", "[snapshot][directory]")
{
  scratch_dir dir;
  directory_transaction tx{dir.path(), "test_save", {}};
  CHECK_THROWS_WITH(tx.place(dir.file("never-staged"), "x"),
                    Contains("test_save") && Contains("was not staged"));
  (void)tx.stage("a.pending", writes("A"));
  CHECK_THROWS_WITH(tx.commit("manifest", bytes_of("m")), Contains("staged but never placed"));
}

TEST_CASE("snapshot directory loads: previous manifest and named-file checks",
          "[snapshot][directory]")
{
  scratch_dir dir;
  auto const parse = [](std::vector<unsigned char> const& b) {
    if (b.size() != 4) { throw logic_error("bad manifest"); }
    return std::string(b.begin(), b.end());
  };
  CHECK_FALSE(previous_manifest(dir.path(), "manifest", parse).has_value());  // none
  write_bytes(dir.file("manifest"), bytes_of("too long"));
  CHECK_FALSE(previous_manifest(dir.path(), "manifest", parse).has_value());  // malformed
  write_bytes(dir.file("manifest"), bytes_of("good"));
  CHECK(previous_manifest(dir.path(), "manifest", parse) == std::optional<std::string>{"good"});

  // a file whose last 8 bytes are 0x0123456789ABCDEF little-endian, and bytes 2..10 another value
  write_bytes(dir.file("data"),
              {0xAA,
               0xBB,
               0x08,
               0x07,
               0x06,
               0x05,
               0x04,
               0x03,
               0x02,
               0x01,
               0xEF,
               0xCD,
               0xAB,
               0x89,
               0x67,
               0x45,
               0x23,
               0x01});
  CHECK_NOTHROW(check_named_files(
    {{dir.file("data"), -8, 0x0123456789ABCDEFull}, {dir.file("data"), 2, 0x0102030405060708ull}},
    "test_load",
    "mismatch"));
  CHECK_THROWS_WITH(check_named_files({{dir.file("data"), 2, 0x0102030405060708ull},
                                       {dir.file("data"), -8, 0x0123456789ABCDEEull}},
                                      "test_load",
                                      "a file of another save"),
                    Contains("test_load: a file of another save"));
  CHECK_THROWS_WITH(check_named_files({{dir.file("gone"), -8, 0}}, "test_load", "mismatch"),
                    Contains("test_load") && Contains("cannot open") && Contains("gone"));
}
