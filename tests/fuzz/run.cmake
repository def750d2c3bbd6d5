# One fuzz target's CTest run: replays the committed corpus, then fuzzes for SECONDS; any crash,
# sanitizer report, leak, out-of-memory or hang (over 10 s on one input) fails the test, and the
# input that did it is left in WORK (crash-*, leak-*, oom-*, timeout-*). New inputs are written to
# WORK/new, never to CORPUS (the sources).
# cmake -DFUZZER=<binary> -DTARGET=<name> -DCORPUS=<dir> -DWORK=<dir> -DSECONDS=<n> -P run.cmake
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK}/new)
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env INFERSCALE_FUZZ_TARGET=${TARGET}
          ${FUZZER} -max_total_time=${SECONDS} -timeout=10 -rss_limit_mb=2048
          -print_final_stats=1 -artifact_prefix=${WORK}/ ${WORK}/new ${CORPUS}
  WORKING_DIRECTORY ${WORK}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "fuzz target ${TARGET}: libFuzzer exited with ${rc}; the input is in ${WORK}")
endif()
