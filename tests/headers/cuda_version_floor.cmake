# Preprocesses config.hpp as nvcc <major>.<minor> would see it and checks the version floor.
function(preprocess major minor out_result out_text)
  execute_process(
    COMMAND ${CXX_COMPILER} -E -x c++ -D__CUDACC__ -D__CUDACC_VER_MAJOR__=${major}
            -D__CUDACC_VER_MINOR__=${minor} -I${INCLUDE_DIR} ${HEADER} -o /dev/null
    RESULT_VARIABLE result ERROR_VARIABLE text OUTPUT_QUIET)
  set(${out_result} ${result} PARENT_SCOPE)
  set(${out_text} "${text}" PARENT_SCOPE)
endfunction()

foreach(version "11;8" "12;0")
  list(GET version 0 major)
  list(GET version 1 minor)
  preprocess(${major} ${minor} result text)
  if(result EQUAL 0 OR NOT text MATCHES "needs CUDA 12.1 or newer")
    message(FATAL_ERROR "config.hpp accepted nvcc ${major}.${minor} (result ${result}): ${text}")
  endif()
endforeach()
foreach(version "12;1" "12;9" "13;0")
  list(GET version 0 major)
  list(GET version 1 minor)
  preprocess(${major} ${minor} result text)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "config.hpp refused nvcc ${major}.${minor}: ${text}")
  endif()
endforeach()
message(STATUS "config.hpp refuses nvcc 11.8 and 12.0 with the message, accepts 12.1, 12.9, 13.0")
