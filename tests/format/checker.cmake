# cmake -DCLANG_FORMAT=<clang-format> -DROOT=<repository> -DWORK_DIR=<scratch> -DSCRIPT=<check.cmake>
#       -P checker.cmake
# format.check's own check: in a scratch tree with the repository's .clang-format, check.cmake
# must fail on a misformatted file (naming it) and pass once clang-format has formatted it.
cmake_minimum_required(VERSION 3.25)

foreach(var CLANG_FORMAT ROOT WORK_DIR SCRIPT)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "checker.cmake: ${var} is not set")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/include")
configure_file("${ROOT}/.clang-format" "${WORK_DIR}/.clang-format" COPYONLY)
# Over 100 columns, a west const and a misplaced brace: three rules of .clang-format broken.
file(WRITE "${WORK_DIR}/include/bad.hpp"
     "#pragma once\nconst int answer_of_every_question_that_was_ever_asked_by_anyone = 42; int f() { return answer_of_every_question_that_was_ever_asked_by_anyone; }\nstruct s\n{\n};\n")

execute_process(COMMAND "${CMAKE_COMMAND}" -DCLANG_FORMAT=${CLANG_FORMAT} -DROOT=${WORK_DIR}
                        -DFILES=include/bad.hpp -P "${SCRIPT}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "format.checker: check.cmake passed a misformatted file:\n${out}${err}")
endif()
if(NOT err MATCHES "1 of 1 files are not formatted" OR NOT err MATCHES "include/bad.hpp")
  message(FATAL_ERROR "format.checker: check.cmake failed without naming the file:\n${out}${err}")
endif()

execute_process(COMMAND "${CLANG_FORMAT}" -i --style=file include/bad.hpp
                WORKING_DIRECTORY "${WORK_DIR}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "format.checker: clang-format -i failed")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" -DCLANG_FORMAT=${CLANG_FORMAT} -DROOT=${WORK_DIR}
                        -DFILES=include/bad.hpp -P "${SCRIPT}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "format.checker: check.cmake failed on the formatted file:\n${out}${err}")
endif()
message(STATUS "format.checker: a misformatted file fails the check, its formatted form passes")
