# cmake -DBINARY_DIR=<build tree> -DPREFIX=<scratch prefix> -P install.cmake
# A fresh prefix each time, so headers removed from the tree do not linger in the test.
foreach(var BINARY_DIR PREFIX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "install.cmake: ${var} is not set")
  endif()
endforeach()
file(REMOVE_RECURSE "${PREFIX}")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BINARY_DIR}" --prefix "${PREFIX}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BINARY_DIR} --prefix ${PREFIX} failed (${rc})")
endif()
file(GLOB_RECURSE config_files "${PREFIX}/*/inferscale-config.cmake")
if(NOT config_files)
  message(FATAL_ERROR "no inferscale-config.cmake under ${PREFIX}")
endif()
message(STATUS "installed: ${config_files}")
