// The device side of graph_index persistence: load_index into device memory puts the saved
// arena on the device, row by row (index_persist.cpp holds the host tests and the fixtures'
// description). Needs a GPU; reported skipped by CTest where none is visible.
#include "index_persist_common.hpp"

using namespace inferscale_index_persist;

TEST_CASE("persist: load into device memory puts the same arena on the device",
          "[index][persist][gpu]")
{
  // the device copy is what the device search reads: read it back through ref() and compare it
  // row by row with the host mirror of the saved index
  scratch_dir dir;
  auto const t = GENERATE(dtype::float32, dtype::float16);
  fact_source source{distance_metric::cosine, 5};
  graph_index const original = make_scenario(t, distance_metric::cosine, source);
  std::string const path     = dir.file("device.isidx");
  save_index(original, path);
  graph_index const loaded = load_index(path, memory_space::device);
  REQUIRE(loaded.space() == memory_space::device);
  require_same_contents(original, loaded);

  detail::index::graph_index_ref const ref = index_access::ref(loaded);
  REQUIRE(ref.vectors != nullptr);
  std::size_t const row_bytes = vector_row_bytes(loaded);
  std::size_t const degree    = index_access::graph_degree(loaded);
  for (std::uint64_t ns : loaded.namespaces()) {
    auto const seg = index_access::tenant_segment(loaded, ns);
    CAPTURE(ns);
    std::vector<unsigned char> vectors(seg.size * row_bytes);
    std::vector<std::uint32_t> graph(seg.size * degree);
    std::vector<std::uint64_t> ids(seg.size);
    std::vector<std::uint8_t> deleted(seg.size);
    if (seg.size == 0) { continue; }
    INFERSCALE_CUDA_TRY(cudaMemcpy(vectors.data(),
                                   static_cast<unsigned char const*>(ref.vectors) +
                                     static_cast<std::size_t>(seg.row_begin) * row_bytes,
                                   vectors.size(),
                                   cudaMemcpyDeviceToHost));
    INFERSCALE_CUDA_TRY(cudaMemcpy(graph.data(),
                                   ref.graph + seg.row_begin * std::int64_t(degree),
                                   graph.size() * 4,
                                   cudaMemcpyDeviceToHost));
    INFERSCALE_CUDA_TRY(
      cudaMemcpy(ids.data(), ref.ids + seg.row_begin, ids.size() * 8, cudaMemcpyDeviceToHost));
    INFERSCALE_CUDA_TRY(cudaMemcpy(
      deleted.data(), ref.deleted + seg.row_begin, deleted.size(), cudaMemcpyDeviceToHost));
    REQUIRE(std::memcmp(vectors.data(), index_access::vector_rows(original, ns), vectors.size()) ==
            0);
    REQUIRE(std::memcmp(graph.data(), index_access::graph_rows(original, ns), graph.size() * 4) ==
            0);
    REQUIRE(std::memcmp(ids.data(), index_access::id_rows(original, ns), ids.size() * 8) == 0);
    REQUIRE(std::memcmp(deleted.data(), index_access::deleted_rows(original, ns), deleted.size()) ==
            0);
  }
}
