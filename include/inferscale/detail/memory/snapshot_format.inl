/**
 * @file detail/memory/snapshot_format.inl
 * @brief Definitions for memory.hpp, the snapshot's binary format: the manifest `memory.ismem`
 * and the lifecycle file (layouts in memory::save's comment), their file names, encoding and
 * checked decoding.
 */
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace inferscale {

struct memory::snapshot_manifest {
  std::optional<std::uint64_t> prefix;
  std::uint64_t store_checksum{};
  std::uint64_t index_header_checksum{};
  std::uint64_t index_checksum{};
  std::uint64_t lifecycle_checksum{};
  /// Version 2: the application file's checksum (save_memory with application data).
  std::optional<std::uint64_t> application_checksum;
};

inline std::string memory::store_file_name(snapshot_manifest const& m)
{
  return "store-" + detail::serial::checksum_digits(m.store_checksum) + ".iskv";
}

inline std::string memory::index_file_name(snapshot_manifest const& m)
{
  return "index-" + detail::serial::checksum_digits(m.index_header_checksum) + "-" +
         detail::serial::checksum_digits(m.index_checksum) + ".isx";
}

inline std::string memory::lifecycle_file_name(snapshot_manifest const& m)
{
  return "lifecycle-" + detail::serial::checksum_digits(m.lifecycle_checksum) + ".islc";
}

inline std::string memory::application_file_name(snapshot_manifest const& m)
{
  return "application-" + detail::serial::checksum_digits(m.application_checksum.value_or(0)) +
         ".isap";
}

/// `bytes` holds manifest_bytes (version 1) or, with an application checksum, manifest_v2_bytes.
inline void memory::encode_manifest(snapshot_manifest const& m, unsigned char* bytes)
{
  namespace s         = detail::serial;
  bool const v2       = m.application_checksum.has_value();
  std::size_t const n = v2 ? manifest_v2_bytes : manifest_bytes;
  std::memset(bytes, 0, n);
  std::memcpy(bytes, manifest_magic, 8);
  s::put_le(bytes + 8, std::uint32_t{v2 ? 2u : 1u});
  s::put_le(bytes + 12, std::uint32_t{0x01020304u});
  bytes[16] = m.prefix ? 1 : 0;
  s::put_le(bytes + 24, m.prefix.value_or(0));
  s::put_le(bytes + 32, m.store_checksum);
  s::put_le(bytes + 40, m.index_header_checksum);
  s::put_le(bytes + 48, m.index_checksum);
  s::put_le(bytes + 56, m.lifecycle_checksum);
  if (v2) { s::put_le(bytes + 64, *m.application_checksum); }
  s::put_le(bytes + n - 8, s::crc64_of(bytes, n - 8));
}

inline memory::snapshot_manifest memory::parse_manifest(std::vector<unsigned char> const& b,
                                                        std::string const& where)
{
  namespace s            = detail::serial;
  std::string const what = where + "manifest " + manifest_name + ": ";
  INFERSCALE_EXPECTS(b.size() == manifest_bytes || b.size() == manifest_v2_bytes,
                     what + std::to_string(b.size()) + " bytes, expected " +
                       std::to_string(manifest_bytes) + " (version 1) or " +
                       std::to_string(manifest_v2_bytes) + " (version 2)");
  INFERSCALE_EXPECTS(std::memcmp(b.data(), manifest_magic, 8) == 0,
                     what + "not an InferScale memory manifest (wrong magic bytes)");
  std::uint32_t const version = s::get_le<std::uint32_t>(b.data() + 8);
  INFERSCALE_EXPECTS(version == 1 || version == 2,
                     what + "format version " + std::to_string(version) +
                       " is not supported (this build reads 1 and 2)");
  std::size_t const n = version == 1 ? manifest_bytes : manifest_v2_bytes;
  INFERSCALE_EXPECTS(b.size() == n,
                     what + "version " + std::to_string(version) + " has " + std::to_string(n) +
                       " bytes, this one " + std::to_string(b.size()));
  INFERSCALE_EXPECTS(s::get_le<std::uint32_t>(b.data() + 12) == 0x01020304u,
                     what + "bad byte-order mark");
  INFERSCALE_EXPECTS(s::get_le<std::uint64_t>(b.data() + n - 8) == s::crc64_of(b.data(), n - 8),
                     what + "checksum mismatch (the manifest is corrupted)");
  bool reserved_zero = true;
  for (std::size_t i = 17; i < 24; ++i) {
    reserved_zero = reserved_zero && b[i] == 0;
  }
  std::uint64_t const prefix = s::get_le<std::uint64_t>(b.data() + 24);
  INFERSCALE_EXPECTS(reserved_zero && b[16] <= 1 && (b[16] == 1 || prefix == 0),
                     what + "bad prefix flag or reserved bytes");
  snapshot_manifest m;
  if (b[16] == 1) { m.prefix = prefix; }
  m.store_checksum        = s::get_le<std::uint64_t>(b.data() + 32);
  m.index_header_checksum = s::get_le<std::uint64_t>(b.data() + 40);
  m.index_checksum        = s::get_le<std::uint64_t>(b.data() + 48);
  m.lifecycle_checksum    = s::get_le<std::uint64_t>(b.data() + 56);
  if (version == 2) { m.application_checksum = s::get_le<std::uint64_t>(b.data() + 64); }
  return m;
}

/// The application file's bytes (save_memory's layout), every field checked.
inline std::string memory::decode_application(std::vector<unsigned char> const& b,
                                              std::string const& what)
{
  namespace s = detail::serial;
  INFERSCALE_EXPECTS(
    b.size() >= 32,
    what + std::to_string(b.size()) + " bytes, shorter than the 32-byte header and checksum");
  INFERSCALE_EXPECTS(
    s::get_le<std::uint64_t>(b.data() + b.size() - 8) == s::crc64_of(b.data(), b.size() - 8),
    what + "checksum mismatch (the file is corrupted)");
  INFERSCALE_EXPECTS(std::memcmp(b.data(), application_magic, 8) == 0,
                     what + "not an InferScale application file (wrong magic bytes)");
  std::uint32_t const version = s::get_le<std::uint32_t>(b.data() + 8);
  INFERSCALE_EXPECTS(
    version == 1,
    what + "format version " + std::to_string(version) + " is not supported (this build reads 1)");
  INFERSCALE_EXPECTS(s::get_le<std::uint32_t>(b.data() + 12) == 0x01020304u,
                     what + "bad byte-order mark");
  std::uint64_t const length = s::get_le<std::uint64_t>(b.data() + 16);
  INFERSCALE_EXPECTS(length == b.size() - 32,
                     what + "records " + std::to_string(length) +
                       " bytes of data, the file holds " + std::to_string(b.size() - 32));
  return std::string(reinterpret_cast<char const*>(b.data() + 24),
                     static_cast<std::size_t>(length));
}

/// Little-endian appends for the lifecycle file.
struct memory::lifecycle_out {
  std::vector<unsigned char> bytes;
  template <class T>
  void put(T v)
  {
    unsigned char b[sizeof(T)];
    detail::serial::put_le(b, v);
    bytes.insert(bytes.end(), b, b + sizeof(T));
  }
  template <class T>
  void put_list(std::vector<T> const& v)
  {
    put(static_cast<std::uint64_t>(v.size()));
    for (T x : v) {
      put(x);
    }
  }
};

/// Bounds-checked little-endian reads of the lifecycle file (every count against what is left).
struct memory::lifecycle_in {
  std::vector<unsigned char> const& bytes;
  std::size_t at;
  std::size_t end;
  std::string const& what;
  template <class T>
  T get()
  {
    INFERSCALE_EXPECTS(end - at >= sizeof(T),
                       what + "truncated record at byte " + std::to_string(at));
    T const v = detail::serial::get_le<T>(bytes.data() + at);
    at += sizeof(T);
    return v;
  }
  template <class T>
  std::vector<T> get_list()
  {
    std::uint64_t const n = get<std::uint64_t>();
    INFERSCALE_EXPECTS(n <= (end - at) / sizeof(T),
                       what + "a list of " + std::to_string(n) + " entries at byte " +
                         std::to_string(at) + " runs past the end");
    std::vector<T> v(static_cast<std::size_t>(n));
    for (auto& x : v) {
      x = get<T>();
    }
    return v;
  }
  void zeros(std::size_t n)
  {
    for (std::size_t i = 0; i < n; ++i) {
      INFERSCALE_EXPECTS(get<std::uint8_t>() == 0,
                         what + "reserved byte " + std::to_string(at - 1) + " is not zero");
    }
  }
};

inline std::vector<unsigned char> memory::encode_lifecycle() const
{
  lifecycle_out o;
  o.bytes.insert(o.bytes.end(), lifecycle_magic, lifecycle_magic + 8);
  o.put(std::uint32_t{1});
  o.put(std::uint32_t{0x01020304u});
  o.put(next_conversation_);
  o.put(static_cast<std::uint64_t>(conversation_entries_.size()));
  o.put(static_cast<std::uint64_t>(facts_.size()));
  std::vector<std::uint64_t> handles;
  for (auto const& [h, c] : conversation_entries_) {
    handles.push_back(h);
  }
  std::sort(handles.begin(), handles.end());
  for (std::uint64_t h : handles) {
    conversation_entry const& ce = conversation_entries_.at(h);
    o.put(h);
    o.put(ce.ns);
    o.put(ce.options.window);
    o.put(static_cast<std::uint8_t>(ce.options.strategy));
    for (int i = 0; i < 7; ++i) {
      o.put(std::uint8_t{0});
    }
    o.put(ce.options.stride);
    o.put(ce.options.max_sequence_tokens);
    o.put(ce.options.first_position);
    o.put_list(ce.c.lead);
    o.put(static_cast<std::uint64_t>(ce.c.session_headers.size()));
    for (auto const& header : ce.c.session_headers) {
      o.put_list(header);
    }
    o.put(static_cast<std::uint64_t>(ce.c.turns.size()));
    for (auto const& turn : ce.c.turns) {
      o.put(turn.session);
      o.put(std::uint32_t{0});
      o.put_list(turn.token_ids);
    }
    o.put_list(ce.facts);
  }
  std::vector<std::uint64_t> ids;
  for (auto const& [id, e] : facts_) {
    ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  for (std::uint64_t id : ids) {
    fact_entry const& e = facts_.at(id);
    o.put(id);
    o.put(e.ns);
    o.put(static_cast<std::uint8_t>((e.conversation ? 1 : 0) | (e.supersedes ? 2 : 0) |
                                    (e.superseded_by ? 4 : 0)));
    for (int i = 0; i < 7; ++i) {
      o.put(std::uint8_t{0});
    }
    o.put(e.conversation.value_or(0));
    o.put(e.supersedes.value_or(0));
    o.put(e.superseded_by.value_or(0));
    o.put(e.first_turn);
    o.put(e.first_position);
    o.put_list(e.source_turns);
    o.put_list(e.context);
    o.put_list(e.turns);
  }
  o.put(detail::serial::crc64_of(o.bytes.data(), o.bytes.size()));
  return std::move(o.bytes);
}

inline void memory::decode_lifecycle(std::vector<unsigned char> const& b, std::string const& what)
{
  INFERSCALE_EXPECTS(
    b.size() >= 48,
    what + std::to_string(b.size()) + " bytes, shorter than the 48-byte header and checksum");
  INFERSCALE_EXPECTS(detail::serial::get_le<std::uint64_t>(b.data() + b.size() - 8) ==
                       detail::serial::crc64_of(b.data(), b.size() - 8),
                     what + "checksum mismatch (the file is corrupted)");
  INFERSCALE_EXPECTS(std::memcmp(b.data(), lifecycle_magic, 8) == 0,
                     what + "not an InferScale lifecycle file (wrong magic bytes)");
  lifecycle_in in{b, 8, b.size() - 8, what};
  std::uint32_t const version = in.get<std::uint32_t>();
  INFERSCALE_EXPECTS(
    version == 1,
    what + "format version " + std::to_string(version) + " is not supported (this build reads 1)");
  INFERSCALE_EXPECTS(in.get<std::uint32_t>() == 0x01020304u, what + "bad byte-order mark");
  std::uint64_t const next = in.get<std::uint64_t>();
  std::uint64_t const nc   = in.get<std::uint64_t>();
  std::uint64_t const nf   = in.get<std::uint64_t>();
  INFERSCALE_EXPECTS(next >= 1 && nc < next && nc <= b.size() && nf <= b.size(),
                     what + "bad counts (next handle " + std::to_string(next) + ", " +
                       std::to_string(nc) + " conversations, " + std::to_string(nf) + " facts)");
  std::unordered_map<std::uint64_t, conversation_entry> conversations;
  std::uint64_t previous = 0;
  for (std::uint64_t i = 0; i < nc; ++i) {
    std::uint64_t const h = in.get<std::uint64_t>();
    INFERSCALE_EXPECTS(h > previous && h < next,
                       what + "conversation handle " + std::to_string(h) +
                         " out of order or not below the next handle " + std::to_string(next));
    previous = h;
    conversation_entry ce;
    ce.ns                       = in.get<std::uint64_t>();
    ce.options.window           = in.get<std::int64_t>();
    std::uint8_t const strategy = in.get<std::uint8_t>();
    INFERSCALE_EXPECTS(strategy <= static_cast<std::uint8_t>(encoding_strategy::single_pass),
                       what + "bad encoding strategy " + std::to_string(strategy));
    ce.options.strategy = static_cast<encoding_strategy>(strategy);
    in.zeros(7);
    ce.options.stride              = in.get<std::int64_t>();
    ce.options.max_sequence_tokens = in.get<std::int64_t>();
    ce.options.first_position      = in.get<std::int64_t>();
    ce.c.lead                      = in.get_list<std::int32_t>();
    std::uint64_t const headers    = in.get<std::uint64_t>();
    INFERSCALE_EXPECTS(headers <= (in.end - in.at) / 8, what + "too many session headers");
    for (std::uint64_t k = 0; k < headers; ++k) {
      ce.c.session_headers.push_back(in.get_list<std::int32_t>());
    }
    std::uint64_t const turns = in.get<std::uint64_t>();
    INFERSCALE_EXPECTS(turns <= (in.end - in.at) / 16, what + "too many turns");
    for (std::uint64_t k = 0; k < turns; ++k) {
      conversation_turn t;
      t.session = in.get<std::int32_t>();
      in.zeros(4);
      t.token_ids = in.get_list<std::int32_t>();
      ce.c.turns.push_back(std::move(t));
    }
    ce.facts = in.get_list<std::uint64_t>();
    conversations.emplace(h, std::move(ce));
  }
  std::unordered_map<std::uint64_t, fact_entry> facts;
  bool first            = true;
  std::uint64_t last_id = 0;
  for (std::uint64_t i = 0; i < nf; ++i) {
    std::uint64_t const id = in.get<std::uint64_t>();
    INFERSCALE_EXPECTS(first || id > last_id,
                       what + "fact ids out of order at " + std::to_string(id));
    first   = false;
    last_id = id;
    fact_entry e;
    e.ns                     = in.get<std::uint64_t>();
    std::uint8_t const flags = in.get<std::uint8_t>();
    INFERSCALE_EXPECTS(
      flags <= 7, what + "bad flags " + std::to_string(flags) + " of fact " + std::to_string(id));
    in.zeros(7);
    std::uint64_t const conversation  = in.get<std::uint64_t>();
    std::uint64_t const supersedes    = in.get<std::uint64_t>();
    std::uint64_t const superseded_by = in.get<std::uint64_t>();
    INFERSCALE_EXPECTS(((flags & 1) || conversation == 0) && ((flags & 2) || supersedes == 0) &&
                         ((flags & 4) || superseded_by == 0),
                       what + "fact " + std::to_string(id) + " has a link without its flag");
    if (flags & 1) { e.conversation = conversation; }
    if (flags & 2) { e.supersedes = supersedes; }
    if (flags & 4) { e.superseded_by = superseded_by; }
    e.first_turn     = in.get<std::int64_t>();
    e.first_position = in.get<std::int64_t>();
    e.source_turns   = in.get_list<std::int64_t>();
    e.context        = in.get_list<std::int32_t>();
    e.turns          = in.get_list<std::int64_t>();
    facts.emplace(id, std::move(e));
  }
  INFERSCALE_EXPECTS(in.at == in.end,
                     what + std::to_string(in.end - in.at) + " bytes after the last record");

  // Agreement with the store, the index and itself.
  for (auto const& [id, e] : facts) {
    std::string const f = what + "fact " + std::to_string(id) + ": ";
    INFERSCALE_EXPECTS(store_.contains(id) && store_.at(id).namespace_id == e.ns,
                       f + "not in the store's namespace " + std::to_string(e.ns));
    INFERSCALE_EXPECTS(!prefix_ || *prefix_ != id, f + "is the instruction prefix");
    INFERSCALE_EXPECTS(
      index_.contains(id) == !e.superseded_by,
      f + (e.superseded_by ? "superseded but still indexed" : "retrievable but not indexed"));
    // The links are history: they may name a fact erased since (fact_state), but never the fact
    // itself.
    INFERSCALE_EXPECTS(e.superseded_by != id && e.supersedes != id,
                       f + "supersedes or is superseded by itself");
    if (e.conversation) {
      auto const cit = conversations.find(*e.conversation);
      INFERSCALE_EXPECTS(cit != conversations.end() && cit->second.ns == e.ns,
                         f + "planned from conversation " + std::to_string(*e.conversation) +
                           ", which is not kept for its namespace");
      auto const& listed = cit->second.facts;
      INFERSCALE_EXPECTS(std::find(listed.begin(), listed.end(), id) != listed.end(),
                         f + "not listed by its conversation");
      std::int64_t const turns = static_cast<std::int64_t>(cit->second.c.turns.size());
      INFERSCALE_EXPECTS(!e.source_turns.empty(), f + "no source turn");
      for (std::int64_t t : e.source_turns) {
        INFERSCALE_EXPECTS(t >= 0 && t < turns,
                           f + "source turn " + std::to_string(t) + " outside the conversation's " +
                             std::to_string(turns) + " turns");
      }
      INFERSCALE_EXPECTS(
        e.first_turn >= 0 && e.first_turn <= anchor(e.source_turns),
        f + "window start " + std::to_string(e.first_turn) + " after its source turn");
    }
  }
  for (auto const& [h, ce] : conversations) {
    for (std::uint64_t id : ce.facts) {
      auto const fit = facts.find(id);
      INFERSCALE_EXPECTS(fit != facts.end() && fit->second.conversation == h,
                         what + "conversation " + std::to_string(h) + " lists fact " +
                           std::to_string(id) + ", which is not planned from it");
    }
  }
  facts_                = std::move(facts);
  conversation_entries_ = std::move(conversations);
  next_conversation_    = next;
}

}  // namespace inferscale
