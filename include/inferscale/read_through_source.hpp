/**
 * @file read_through_source.hpp
 * @brief A Redis tier in front of a slower source (a snapshot directory on disk, typically):
 * `read_through_source` serves each fact from Redis when Redis holds it and reads the others from
 * the source behind, writing them into Redis as it goes, so the next replica that needs them
 * (or this one, after its LRU dropped them) finds them there. LMCache's arrangement of a shared
 * remote tier over local disk, as a fact_source for tiered_store::admit.
 *
 * The source behind is the authority; Redis is a cache of it. So:
 *  - the generation returned is the source behind's (a directory source's is constant: one save);
 *    a Redis namespace's own generation is not used;
 *  - Redis must be dedicated to this source's facts: name it in `redis_options::model` (for
 *    example the model and the snapshot's identity), so two different saves never share keys;
 *  - a fact Redis holds with other bytes than the source behind (a damaged value: refused by its
 *    checksum; a value of another save, or of a fact the source behind no longer holds: told by
 *    fact_source::matches, which a directory answers from its fact table without reading) is
 *    read from behind, and Redis's copy replaced (or the fetch fails as the source behind's);
 *  - Redis being unreachable is not a failure: every fact is read from behind (counted in
 *    `stats().front_unavailable`), and backfilling stops for that fetch. A failure of the source
 *    behind is the fetch's failure (logic_error or source_unavailable, as that source throws),
 *    and then nothing is written to Redis.
 *
 * Plain C++17, hiredis (through redis_source.hpp). One per thread, as its two sources.
 */
#pragma once

#include <inferscale/error.hpp>
#include <inferscale/fact_source.hpp>
#include <inferscale/redis_source.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace inferscale {

/// @brief What a read_through_source did since it was made (for metrics and tests).
struct read_through_stats {
  std::int64_t front_hits{};         ///< facts served from Redis
  std::int64_t back_reads{};         ///< facts read from the source behind
  std::int64_t backfilled{};         ///< of those, written to Redis
  std::int64_t replaced{};           ///< Redis values replaced (damaged, or of other bytes)
  std::int64_t front_unavailable{};  ///< fetches served without Redis (it could not be reached)
  std::string last_front_error;      ///< the last Redis failure's message (empty if none)
};

/**
 * @brief A fact_source that reads through a Redis tier (`front`) to a source behind it (`back`).
 * Both must outlive it; they must have the same page layout.
 */
class read_through_source final : public fact_source {
 public:
  /// @throw logic_error if the two sources hold pages of different layouts
  read_through_source(redis_fact_store& front, fact_source& back) : front_{front}, back_{back}
  {
    INFERSCALE_EXPECTS(front.layout() == back.layout(),
                       "read_through_source: " + front.name() + " holds pages of " +
                         front.layout().describe() + ", " + back.name() + " of " +
                         back.layout().describe());
  }

  fact_layout const& layout() const override { return back_.layout(); }

  std::string name() const override { return front_.name() + " in front of " + back_.name(); }

  read_through_stats const& stats() const noexcept { return stats_; }

  /**
   * @brief The facts `ids` of namespace `ns`: those Redis holds (checked by their checksums)
   * from Redis, the others from the source behind, which are then written to Redis.
   * @return the source behind's generation, and the facts in the order asked
   * @throw logic_error if an id is asked for twice, or as the source behind throws (a fact it
   *        lacks, a damaged fact); source_unavailable if the source behind cannot be reached.
   *        Nothing is written to Redis then.
   */
  fetched_namespace fetch(std::uint64_t ns, std::vector<std::uint64_t> const& ids) override
  {
    std::unordered_set<std::uint64_t> asked;
    for (std::uint64_t id : ids) {
      INFERSCALE_EXPECTS(
        asked.insert(id).second,
        "read_through_source::fetch: fact " + std::to_string(id) + " is asked for twice");
    }
    std::unordered_map<std::uint64_t, fetched_fact> found;
    bool front_up = true;
    std::unordered_set<std::uint64_t> damaged;  // in Redis with a value that was refused
    try {
      // Every fact in Redis (the common case once warm): one transaction. Else the user's
      // catalogue says which Redis holds, and those are fetched.
      bool whole = false;
      if (!ids.empty()) {
        std::vector<fetched_fact> all;
        try {
          all   = front_.fetch(ns, ids).facts;
          whole = true;
        } catch (logic_error const&) {  // a fact absent or refused: found out below
        }
        if (whole) { accept(std::move(all), found, damaged); }
      }
      if (!whole) {
        std::vector<std::uint64_t> held;
        for (std::uint64_t id : front_.namespace_fact_ids(ns)) {
          if (asked.count(id) != 0) { held.push_back(id); }
        }
        if (!held.empty()) { take_from_front(ns, held, found, damaged); }
      }
    } catch (source_unavailable const& e) {
      front_unreachable(e, found, front_up);
    }

    std::vector<std::uint64_t> missing;
    for (std::uint64_t id : ids) {
      if (found.count(id) == 0) { missing.push_back(id); }
    }
    fetched_namespace behind = back_.fetch(ns, missing);  // throws: nothing written, nothing kept
    stats_.front_hits += static_cast<std::int64_t>(found.size());
    stats_.back_reads += static_cast<std::int64_t>(behind.facts.size());
    for (fetched_fact& f : behind.facts) {
      if (front_up) { front_up = backfill(f, damaged.count(f.fact_id) != 0); }
      found.emplace(f.fact_id, std::move(f));
    }
    fetched_namespace out;
    out.generation = behind.generation;
    out.facts.reserve(ids.size());
    for (std::uint64_t id : ids) {
      out.facts.push_back(std::move(found.at(id)));
    }
    return out;
  }

 private:
  /// Redis's values of `held` (ids its catalogue lists), in one transaction; where that is
  /// refused (a damaged value, a fact erased meanwhile), one fact at a time, the refused ones
  /// left to the source behind.
  void take_from_front(std::uint64_t ns,
                       std::vector<std::uint64_t> const& held,
                       std::unordered_map<std::uint64_t, fetched_fact>& found,
                       std::unordered_set<std::uint64_t>& damaged)
  {
    std::vector<fetched_fact> taken;
    try {
      taken = front_.fetch(ns, held).facts;
    } catch (logic_error const&) {
      for (std::uint64_t id : held) {
        try {
          taken.push_back(std::move(front_.fetch(ns, {id}).facts.front()));
        } catch (logic_error const& e) {
          damaged.insert(id);
          stats_.last_front_error = e.what();
        }
      }
    }
    accept(std::move(taken), found, damaged);
  }

  /// Keeps the facts taken from Redis that the source behind does not refuse.
  void accept(std::vector<fetched_fact> taken,
              std::unordered_map<std::uint64_t, fetched_fact>& found,
              std::unordered_set<std::uint64_t>& damaged)
  {
    for (fetched_fact& f : taken) {
      // A value that is not the source behind's fact (another save's, or a fact it no longer
      // holds) is left to the source behind, where that source can tell.
      if (back_.matches(f) == std::optional<bool>{false}) {
        damaged.insert(f.fact_id);
        stats_.last_front_error = "read_through_source: " + front_.name() + " holds fact " +
                                  std::to_string(f.fact_id) + " with other contents than " +
                                  back_.name();
        continue;
      }
      std::uint64_t const id = f.fact_id;
      found.emplace(id, std::move(f));
    }
  }

  /// Redis cannot be reached: every fact from behind, no backfill for this fetch.
  void front_unreachable(source_unavailable const& e,
                         std::unordered_map<std::uint64_t, fetched_fact>& found,
                         bool& front_up)
  {
    found.clear();
    front_up = false;
    ++stats_.front_unavailable;
    stats_.last_front_error = e.what();
  }

  /// Writes `f` into Redis (replacing Redis's value where it was refused or differs); false when
  /// Redis cannot be reached (no more writes in this fetch).
  bool backfill(fetched_fact const& f, bool replace)
  {
    try {
      if (replace) {
        (void)front_.erase(f.namespace_id, f.fact_id);
        ++stats_.replaced;
      }
      try {
        if (front_.put(f)) { ++stats_.backfilled; }
      } catch (logic_error const& e) {  // Redis holds other bytes under the id: the back's win
        stats_.last_front_error = e.what();
        (void)front_.erase(f.namespace_id, f.fact_id);
        ++stats_.replaced;
        if (front_.put(f)) { ++stats_.backfilled; }
      }
      return true;
    } catch (source_unavailable const& e) {
      ++stats_.front_unavailable;
      stats_.last_front_error = e.what();
      return false;
    } catch (logic_error const& e) {  // e.g. writers kept conflicting: the fact is still served
      stats_.last_front_error = e.what();
      return true;
    }
  }

  redis_fact_store& front_;
  fact_source& back_;
  read_through_stats stats_;
};

}  // namespace inferscale
