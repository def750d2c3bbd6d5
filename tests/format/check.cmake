# cmake -DCLANG_FORMAT=<clang-format 14> -DROOT=<repository> [-DFILES=<a;b;...>] -P check.cmake
# Fails, naming each file and its first difference, when a C++ file differs from what
# clang-format makes of it with ROOT/.clang-format. FILES (relative to ROOT): the files to check;
# by default the tracked C++ files of include/, tests/, bench/, examples/ and cmake/ (git ls-files;
# a tree without git: the same folders globbed).
cmake_minimum_required(VERSION 3.25)

foreach(var CLANG_FORMAT ROOT)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "check.cmake: ${var} is not set")
  endif()
endforeach()
set(folders include tests bench examples cmake)
set(patterns *.cpp *.hpp *.cu *.cuh *.inl *.h)

if(NOT DEFINED FILES)
  set(FILES "")
  find_program(GIT git)
  if(GIT AND EXISTS "${ROOT}/.git")
    set(pathspecs "")
    foreach(folder IN LISTS folders)
      foreach(pattern IN LISTS patterns)
        list(APPEND pathspecs "${folder}/${pattern}")
      endforeach()
    endforeach()
    execute_process(COMMAND "${GIT}" ls-files -- ${pathspecs} WORKING_DIRECTORY "${ROOT}"
                    OUTPUT_VARIABLE listed RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "format.check: git ls-files failed in ${ROOT}")
    endif()
    string(REPLACE "\n" ";" FILES "${listed}")
    list(FILTER FILES EXCLUDE REGEX "^$")
  else()
    foreach(folder IN LISTS folders)
      foreach(pattern IN LISTS patterns)
        file(GLOB_RECURSE found RELATIVE "${ROOT}" "${ROOT}/${folder}/${pattern}")
        list(APPEND FILES ${found})
      endforeach()
    endforeach()
  endif()
  list(FILTER FILES EXCLUDE REGEX "^tests/fuzz/corpus/")
endif()
list(LENGTH FILES count)
if(count EQUAL 0)
  message(FATAL_ERROR "format.check: no C++ file found under ${ROOT}")
endif()

execute_process(COMMAND "${CLANG_FORMAT}" --dry-run --Werror --style=file ${FILES}
                WORKING_DIRECTORY "${ROOT}" RESULT_VARIABLE rc ERROR_VARIABLE report
                OUTPUT_VARIABLE out)
if(NOT rc EQUAL 0)
  string(REGEX MATCHALL "[^\n:]+:[0-9]+:[0-9]+: error: code should be clang-formatted" hits
         "${report}")
  set(bad "")
  foreach(hit IN LISTS hits)
    string(REGEX REPLACE ":[0-9]+:[0-9]+: error:.*$" "" file "${hit}")
    list(APPEND bad "${file}")
  endforeach()
  list(REMOVE_DUPLICATES bad)
  list(LENGTH bad bad_count)
  list(JOIN bad "\n  " bad_list)
  message("${report}")
  message(FATAL_ERROR "format.check: ${bad_count} of ${count} files are not formatted "
                      "(clang-format -i <file>, clang-format 14):\n  ${bad_list}")
endif()
message(STATUS "format.check: ${count} files formatted")
