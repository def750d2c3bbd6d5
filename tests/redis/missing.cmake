# Fails the test that runs it with MESSAGE (a dependency the test needs is missing).
message(FATAL_ERROR "${MESSAGE}")
