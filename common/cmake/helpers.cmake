# The build's helper functions (included by the top CMakeLists.txt).

# Test files are compiled with -Og where the build optimizes: the code under
# test keeps the build's -O2 (it is in the libraries), and at -O2 the test
# files, gtest's macros inlined many times over, took 43 % of the build's
# compile time (323 of 757 CPU s on 2 cores; 212 s at -Og, which keeps the
# warnings that need the optimizer; daemon_test.cc 24.6 s -> 11.1 s). The
# unit and integration tests run as fast (20.9 s against 19.4 s).
function(shardcast_test_code target)
  target_compile_options(${target} PRIVATE $<$<CONFIG:RelWithDebInfo,Release>:-Og>)
endfunction()

# shardcast_test(<name> <source> LABEL <label> [LIBS ...]): one gtest binary
# per test file, registered with ctest under a label (LevelDB's leveldb_test),
# linked with the test helpers (common/testing/).
function(shardcast_test name source)
  cmake_parse_arguments(ARG "" "LABEL" "LIBS" ${ARGN})
  add_executable(${name} ${source})
  shardcast_test_code(${name})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} shardcast_testing
    GTest::gtest GTest::gtest_main)
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABEL}" TIMEOUT 300)
endfunction()

# shardcast_forbid_includes(<target> PATTERN <regex> WHY <text>
#                           FILES <files>... [CHECK <name>]): a build step of
# <target> that fails when one of the files includes a header matching
# <regex>, so that a layer boundary (docs/architecture.md) is checked, not
# just agreed on. CHECK names a second (third...) check of one target.
function(shardcast_forbid_includes target)
  cmake_parse_arguments(ARG "" "PATTERN;WHY;CHECK" "FILES" ${ARGN})
  if(NOT ARG_CHECK)
    set(ARG_CHECK includes)
  endif()
  set(files "")
  foreach(f ${ARG_FILES})
    get_filename_component(abs ${f} ABSOLUTE)
    list(APPEND files ${abs})
  endforeach()
  string(REPLACE ";" " " files_arg "${files}")
  set(script ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/forbid_includes.cmake)
  set(stamp ${CMAKE_CURRENT_BINARY_DIR}/${target}_${ARG_CHECK}.ok)
  add_custom_command(OUTPUT ${stamp}
    COMMAND ${CMAKE_COMMAND} "-DFILES=${files_arg}" "-DPATTERN=${ARG_PATTERN}"
            "-DWHY=${ARG_WHY}" -P ${script}
    COMMAND ${CMAKE_COMMAND} -E touch ${stamp}
    DEPENDS ${files} ${script}
    COMMENT "Checking the includes of ${target}"
    VERBATIM)
  add_custom_target(${target}_${ARG_CHECK} DEPENDS ${stamp})
  add_dependencies(${target} ${target}_${ARG_CHECK})
endfunction()
