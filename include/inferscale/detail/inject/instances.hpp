/**
 * @file detail/inject/instances.hpp
 * @brief The list of host injection and extraction instances a program may compile once: the
 * injection loops (every dtype pair, layout and vector level: inject_host_loops, once for the
 * cos/sin tables and once for rope_params),
 * and for each rotation the library ships (rope_params and the engine cos/sin tables of float,
 * bfloat16 and float16) the front of the injection (inject_host_view) and the extraction loops
 * (extract_host_view).
 *
 * `INFERSCALE_INJECT_HOST_INSTANCES(extern)` and `INFERSCALE_EXTRACT_HOST_INSTANCES(extern)`
 * declare them (inject.hpp and extract.hpp do, when the program defines
 * INFERSCALE_EXTERN_TEMPLATES); `INFERSCALE_HOST_INSTANCES()` defines both (instances.hpp, in one
 * translation unit). Another rotation type is instantiated where it is used, as without the macro.
 */
#pragma once

#define INFERSCALE_HOST_LOOP_INSTANCE(PREFIX, TABLE)                   \
  PREFIX template void ::inferscale::detail::inject_host_loops<TABLE>( \
    ::inferscale::kv_store_ref const&,                                 \
    ::inferscale::injection_batch_view const&,                         \
    ::inferscale::paged_kv_cache const&,                               \
    ::inferscale::detail::host_rotation const&);

#define INFERSCALE_HOST_LOOP_INSTANCES(PREFIX) \
  INFERSCALE_HOST_LOOP_INSTANCE(PREFIX, false) \
  INFERSCALE_HOST_LOOP_INSTANCE(PREFIX, true)

#define INFERSCALE_INJECT_HOST_VIEW_INSTANCE(PREFIX, ROTATION)           \
  PREFIX template void ::inferscale::detail::inject_host_view<ROTATION>( \
    ::inferscale::kv_store_ref const&,                                   \
    ::inferscale::injection_batch_view const&,                           \
    ::inferscale::paged_kv_cache const&,                                 \
    ROTATION const&);

#define INFERSCALE_EXTRACT_HOST_VIEW_INSTANCE(PREFIX, CHECK_ONLY, ROTATION)           \
  PREFIX template void ::inferscale::detail::extract_host_view<CHECK_ONLY, ROTATION>( \
    ::inferscale::paged_kv_cache const&,                                              \
    std::int64_t const*,                                                              \
    std::int64_t const*,                                                              \
    std::int64_t const*,                                                              \
    std::int64_t,                                                                     \
    ROTATION const&,                                                                  \
    ::inferscale::kv_store_ref const&,                                                \
    ::inferscale::detail::extraction_fault*);

#define INFERSCALE_EXTRACT_HOST_INSTANCES_FOR(PREFIX, ROTATION) \
  INFERSCALE_EXTRACT_HOST_VIEW_INSTANCE(PREFIX, true, ROTATION) \
  INFERSCALE_EXTRACT_HOST_VIEW_INSTANCE(PREFIX, false, ROTATION)

/// One rotation's injection front and extraction loops.
#define INFERSCALE_HOST_INSTANCES_FOR(PREFIX, ROTATION)  \
  INFERSCALE_INJECT_HOST_VIEW_INSTANCE(PREFIX, ROTATION) \
  INFERSCALE_EXTRACT_HOST_INSTANCES_FOR(PREFIX, ROTATION)

/// The injection's instances (inject.hpp declares them extern).
#define INFERSCALE_INJECT_HOST_INSTANCES(PREFIX)                                                   \
  INFERSCALE_HOST_LOOP_INSTANCES(PREFIX)                                                           \
  INFERSCALE_INJECT_HOST_VIEW_INSTANCE(PREFIX, ::inferscale::rope_params)                          \
  INFERSCALE_INJECT_HOST_VIEW_INSTANCE(PREFIX, ::inferscale::rope_cos_sin_table<float>)            \
  INFERSCALE_INJECT_HOST_VIEW_INSTANCE(PREFIX,                                                     \
                                       ::inferscale::rope_cos_sin_table<::inferscale::bfloat16_t>) \
  INFERSCALE_INJECT_HOST_VIEW_INSTANCE(PREFIX,                                                     \
                                       ::inferscale::rope_cos_sin_table<::inferscale::half_t>)

/// The extraction's instances (extract.hpp declares them extern).
#define INFERSCALE_EXTRACT_HOST_INSTANCES(PREFIX)                                        \
  INFERSCALE_EXTRACT_HOST_INSTANCES_FOR(PREFIX, ::inferscale::rope_params)               \
  INFERSCALE_EXTRACT_HOST_INSTANCES_FOR(PREFIX, ::inferscale::rope_cos_sin_table<float>) \
  INFERSCALE_EXTRACT_HOST_INSTANCES_FOR(                                                 \
    PREFIX, ::inferscale::rope_cos_sin_table<::inferscale::bfloat16_t>)                  \
  INFERSCALE_EXTRACT_HOST_INSTANCES_FOR(PREFIX,                                          \
                                        ::inferscale::rope_cos_sin_table<::inferscale::half_t>)

/// Both (instances.hpp defines them).
#define INFERSCALE_HOST_INSTANCES(PREFIX)  \
  INFERSCALE_INJECT_HOST_INSTANCES(PREFIX) \
  INFERSCALE_EXTRACT_HOST_INSTANCES(PREFIX)
