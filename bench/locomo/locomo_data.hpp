/**
 * @file locomo_data.hpp
 * @brief Reading LoCoMo (`../shared/data/locomo/locomo10.json`, CC BY-NC 4.0, read in place and
 * never copied; Maharana et al., ACL 2024) into conversations, observation facts and QA, and
 * laying them out as the text the model reads: the format of turns, session headers, facts and
 * the instruction prefix is chosen here (the data set prescribes none).
 */
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace inferscale::locomo {

struct data_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct turn {
  std::string speaker;
  std::string dia_id;
  std::string text;
  std::string caption;  ///< blip_caption of a shared image, or empty
  int session{};        ///< 0-based index into sample::sessions
};

struct session {
  int number{};           ///< N of session_N
  std::string date_time;  ///< e.g. "1:56 pm on 8 May, 2023"
};

struct fact {
  std::string speaker;
  std::string text;
  std::vector<std::int64_t> turns;  ///< evidence turns (indices into sample::turns)
  int session{};
};

struct question {
  std::string text;
  std::string answer;                  ///< category 5: empty (the conversation does not say)
  std::vector<std::int64_t> evidence;  ///< evidence turns that exist
  std::int64_t dangling_evidence{0};   ///< evidence strings naming no turn
  int category{};  ///< 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial
};

struct sample {
  std::string id;
  std::string speaker_a, speaker_b;
  std::vector<session> sessions;
  std::vector<turn> turns;
  std::vector<fact> facts;
  std::vector<question> questions;
};

inline char const* category_name(int c)
{
  switch (c) {
    case 1: return "multi-hop";
    case 2: return "temporal";
    case 3: return "open-domain";
    case 4: return "single-hop";
    case 5: return "adversarial";
  }
  return "?";
}

/// @brief The data file: $INFERSCALE_LOCOMO, else the compiled-in default (../shared/...).
inline std::string default_path()
{
  if (char const* p = std::getenv("INFERSCALE_LOCOMO")) { return p; }
#ifdef INFERSCALE_LOCOMO_DEFAULT
  return INFERSCALE_LOCOMO_DEFAULT;
#else
  return "../shared/data/locomo/locomo10.json";
#endif
}

namespace detail {
inline std::string as_text(nlohmann::json const& v)
{
  if (v.is_string()) { return v.get<std::string>(); }
  if (v.is_number_integer()) { return std::to_string(v.get<long long>()); }
  if (v.is_number()) {
    std::ostringstream s;
    s << v.get<double>();
    return s.str();
  }
  return v.dump();
}

/// Dia ids in an evidence string: "D1:3", "D22:21, D22:23", "D8:6; D9:17".
inline std::vector<std::string> split_ids(std::string const& s)
{
  std::vector<std::string> out;
  std::string cur;
  for (char ch : s) {
    if (ch == ',' || ch == ';' || std::isspace(static_cast<unsigned char>(ch))) {
      if (!cur.empty()) { out.push_back(cur); }
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (!cur.empty()) { out.push_back(cur); }
  return out;
}

inline std::vector<std::string> evidence_ids(nlohmann::json const& v)
{
  std::vector<std::string> out;
  if (v.is_string()) { return split_ids(v.get<std::string>()); }
  if (v.is_array()) {
    for (auto const& e : v) {
      for (auto const& id : split_ids(as_text(e))) {
        out.push_back(id);
      }
    }
  }
  return out;
}
}  // namespace detail

/**
 * @brief Loads every sample of locomo10.json.
 * @throw data_error with the path and the problem: a missing file, malformed JSON, a sample
 *        without its keys, a fact whose evidence names no turn.
 */
inline std::vector<sample> load(std::string const& path)
{
  std::ifstream in{path};
  if (!in) {
    throw data_error("LoCoMo: cannot open '" + path +
                     "' (the data set lives in ../shared/data/locomo/locomo10.json beside the "
                     "project; set INFERSCALE_LOCOMO to its path)");
  }
  nlohmann::json doc;
  try {
    in >> doc;
  } catch (std::exception const& e) {
    throw data_error("LoCoMo: '" + path + "' is not valid JSON: " + e.what());
  }
  if (!doc.is_array() || doc.empty()) {
    throw data_error("LoCoMo: '" + path + "' is not a list of samples");
  }
  std::vector<sample> out;
  for (auto const& s : doc) {
    sample x;
    try {
      x.id             = s.at("sample_id").get<std::string>();
      auto const& conv = s.at("conversation");
      x.speaker_a      = conv.at("speaker_a").get<std::string>();
      x.speaker_b      = conv.at("speaker_b").get<std::string>();
      std::map<std::string, std::int64_t> turn_of;
      for (int n = 1;; ++n) {
        std::string const key = "session_" + std::to_string(n);
        if (!conv.contains(key)) { break; }
        int const index = static_cast<int>(x.sessions.size());
        x.sessions.push_back({n, conv.at(key + "_date_time").get<std::string>()});
        for (auto const& t : conv.at(key)) {
          turn tt;
          tt.speaker = t.at("speaker").get<std::string>();
          tt.dia_id  = t.at("dia_id").get<std::string>();
          tt.text    = t.at("text").get<std::string>();
          if (t.contains("blip_caption")) { tt.caption = t.at("blip_caption").get<std::string>(); }
          tt.session         = index;
          turn_of[tt.dia_id] = static_cast<std::int64_t>(x.turns.size());
          x.turns.push_back(tt);
        }
      }
      auto const& obs = s.at("observation");
      for (std::size_t si = 0; si < x.sessions.size(); ++si) {
        std::string const key = "session_" + std::to_string(x.sessions[si].number) + "_observation";
        if (!obs.contains(key)) { continue; }
        for (std::string const& speaker : {x.speaker_a, x.speaker_b}) {
          if (!obs.at(key).contains(speaker)) { continue; }
          for (auto const& f : obs.at(key).at(speaker)) {
            fact ff;
            ff.speaker = speaker;
            ff.text    = f.at(0).get<std::string>();
            ff.session = static_cast<int>(si);
            for (std::string const& id : detail::evidence_ids(f.at(1))) {
              auto const it = turn_of.find(id);
              if (it == turn_of.end()) {
                throw data_error("LoCoMo: " + x.id + " fact '" + ff.text + "' cites " + id +
                                 ", which is no turn");
              }
              ff.turns.push_back(it->second);
            }
            if (ff.turns.empty()) {
              throw data_error("LoCoMo: " + x.id + " fact '" + ff.text + "' cites no turn");
            }
            x.facts.push_back(ff);
          }
        }
      }
      for (auto const& q : s.at("qa")) {
        question qq;
        qq.text     = q.at("question").get<std::string>();
        qq.category = q.at("category").get<int>();
        if (qq.category != 5 && q.contains("answer")) {
          qq.answer = detail::as_text(q.at("answer"));
        }
        std::set<std::int64_t> ev;
        if (q.contains("evidence")) {
          for (std::string const& id : detail::evidence_ids(q.at("evidence"))) {
            auto const it = turn_of.find(id);
            if (it == turn_of.end()) {
              ++qq.dangling_evidence;
            } else {
              ev.insert(it->second);
            }
          }
        }
        qq.evidence.assign(ev.begin(), ev.end());
        x.questions.push_back(qq);
      }
    } catch (data_error const&) {
      throw;
    } catch (std::exception const& e) {
      throw data_error("LoCoMo: '" + path + "': sample " + x.id + " is malformed: " + e.what());
    }
    out.push_back(std::move(x));
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// The text the model reads (SmolLM2's ChatML)

/// @brief The instruction prefix: a system turn; memories follow it.
inline std::string instruction_prefix()
{
  return "<|im_start|>system\nYou answer questions about a long conversation between two "
         "people. Memories from it follow, each with its date. Answer in a few words.\n";
}

/// @brief "8 May, 2023" from "1:56 pm on 8 May, 2023".
inline std::string date_of(std::string const& date_time)
{
  std::size_t const on = date_time.find(" on ");
  return on == std::string::npos ? date_time : date_time.substr(on + 4);
}

/// @brief A session's header line, written before its first turn in an encoding window.
inline std::string session_header(sample const& s, int session)
{
  return "[Session " + std::to_string(s.sessions[static_cast<std::size_t>(session)].number) + ", " +
         s.sessions[static_cast<std::size_t>(session)].date_time + "]\n";
}

/// @brief A turn as one line: "Caroline: text [shares a photo: caption]".
inline std::string turn_text(turn const& t)
{
  std::string out = t.speaker + ": " + t.text;
  if (!t.caption.empty()) { out += " [shares a photo: " + t.caption + "]"; }
  return out + "\n";
}

/// @brief A fact as one memory line, dated with its session: "[8 May, 2023] Caroline ...".
inline std::string fact_text(sample const& s, fact const& f)
{
  return "[" + date_of(s.sessions[static_cast<std::size_t>(f.session)].date_time) + "] " + f.text +
         "\n";
}

/// @brief The question as the prompt tokens that follow the memory (ChatML user turn).
inline std::string question_turn(std::string const& q)
{
  return "<|im_end|>\n<|im_start|>user\n" + q + "<|im_end|>\n<|im_start|>assistant\n";
}

// ------------------------------------------------------------------------------------------------
// Scores

/// @brief LoCoMo's answer normalisation (lower case, punctuation and articles removed), as words.
inline std::vector<std::string> normalized_words(std::string const& s)
{
  std::string t;
  for (char ch : s) {
    unsigned char const c = static_cast<unsigned char>(ch);
    if (std::ispunct(c)) { continue; }
    t += static_cast<char>(std::tolower(c));
  }
  std::istringstream in{t};
  std::vector<std::string> out;
  std::string w;
  while (in >> w) {
    if (w == "a" || w == "an" || w == "the" || w == "and") { continue; }
    out.push_back(w);
  }
  return out;
}

/// @brief Token F1 of a prediction against a gold answer (multiset overlap of normalised words).
inline double token_f1(std::string const& prediction, std::string const& gold)
{
  std::vector<std::string> const p = normalized_words(prediction);
  std::vector<std::string> const g = normalized_words(gold);
  if (p.empty() || g.empty()) { return p.empty() && g.empty() ? 1.0 : 0.0; }
  std::map<std::string, int> count;
  for (auto const& w : g) {
    ++count[w];
  }
  int common = 0;
  for (auto const& w : p) {
    auto it = count.find(w);
    if (it != count.end() && it->second > 0) {
      ++common;
      --it->second;
    }
  }
  if (common == 0) { return 0.0; }
  double const precision = double(common) / double(p.size());
  double const recall    = double(common) / double(g.size());
  return 2 * precision * recall / (precision + recall);
}

}  // namespace inferscale::locomo
