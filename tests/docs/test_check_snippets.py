#!/usr/bin/env python3
"""Tests of .ci/check_snippets.py (CTest: docs.snippets_checker): it passes a README whose snippets
equal their regions, and fails, naming the problem, on every way a snippet can be wrong, including
a copy of this repository's README and sources with one line of a region altered."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
CHECKER = os.path.join(REPO, ".ci", "check_snippets.py")

SOURCE = """int main()
{
  int unrelated = 0;
  // [snippet:hello]
  int answer = 42;
  if (answer) {
    return answer;
  }
  // [/snippet:hello]
  return unrelated;
}
"""

BLOCK = """int answer = 42;
if (answer) {
  return answer;
}"""


def readme(block=BLOCK, marker="<!-- snippet: src/main.cpp#hello -->", lang="cpp"):
    return f"# Title\n\nText.\n\n{marker}\n```{lang}\n{block}\n```\n\nMore text.\n"


class CheckSnippets(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="check_snippets_")
        os.makedirs(os.path.join(self.root, "src"))
        self.write("src/main.cpp", SOURCE)

    def tearDown(self):
        shutil.rmtree(self.root)

    def write(self, rel, text):
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    def run_checker(self, root=None):
        done = subprocess.run([sys.executable, CHECKER, "--root", root or self.root],
                              capture_output=True, text=True)
        return done.returncode, done.stdout + done.stderr

    def assert_fails(self, needle, root=None):
        code, out = self.run_checker(root)
        self.assertEqual(code, 1, out)
        self.assertIn(needle, out)

    def test_equal_snippet_passes(self):
        self.write("README.md", readme())
        self.write("docs/README.md", readme())  # READMEs in folders are found too
        code, out = self.run_checker()
        self.assertEqual(code, 0, out)
        self.assertIn("2 snippet(s) in 2 README(s)", out)

    def test_altered_block_fails_with_a_diff(self):
        self.write("README.md", readme(BLOCK.replace("42", "43")))
        self.assert_fails("-int answer = 42;")

    def test_altered_source_fails(self):
        self.write("README.md", readme())
        self.write("src/main.cpp", SOURCE.replace("return answer;", "return answer + 1;"))
        self.assert_fails("differs from its source region")

    def test_extra_line_in_block_fails(self):
        self.write("README.md", readme(BLOCK + "\n// one more line"))
        self.assert_fails("differs from its source region")

    def test_readme_in_a_subfolder_is_checked(self):
        self.write("examples/README.md", readme(BLOCK.replace("answer)", "answer != 0)")))
        self.assert_fails("examples/README.md")

    def test_missing_file_fails(self):
        self.write("README.md", readme(marker="<!-- snippet: src/gone.cpp#hello -->"))
        self.assert_fails("src/gone.cpp, which does not exist")

    def test_missing_region_fails(self):
        self.write("README.md", readme(marker="<!-- snippet: src/main.cpp#goodbye -->"))
        self.assert_fails("no region 'goodbye' in src/main.cpp (regions: hello)")

    def test_unclosed_region_fails(self):
        self.write("README.md", readme())
        self.write("src/main.cpp", SOURCE.replace("  // [/snippet:hello]\n", ""))
        self.assert_fails("region 'hello' is never closed")

    def test_region_opened_twice_fails(self):
        self.write("README.md", readme())
        self.write("src/main.cpp", SOURCE + "// [snippet:hello]\n// [/snippet:hello]\n")
        self.assert_fails("region 'hello' opened twice")

    def test_marker_without_block_fails(self):
        self.write("README.md", "<!-- snippet: src/main.cpp#hello -->\n\nno block here\n")
        self.assert_fails("snippet marker not followed by a fenced block")

    def test_unclosed_fence_fails(self):
        self.write("README.md", "<!-- snippet: src/main.cpp#hello -->\n```cpp\n" + BLOCK + "\n")
        self.assert_fails("fenced block never closed")

    def test_unmarked_cpp_block_fails_and_illustrative_passes(self):
        self.write("README.md", readme(marker="Some code:"))
        self.assert_fails("block without a snippet marker")
        self.write("README.md", readme(marker="<!-- illustrative: a shape, not compiled -->"))
        code, out = self.run_checker()
        self.assertEqual(code, 0, out)
        # other languages need no marker
        self.write("README.md", readme(marker="Run:", lang="bash"))
        code, out = self.run_checker()
        self.assertEqual(code, 0, out)

    def test_indented_region_and_block_compare_dedented(self):
        self.write("README.md", "- a list item:\n  <!-- snippet: src/main.cpp#hello -->\n"
                   "  ```cpp\n" + "\n".join("  " + l for l in BLOCK.split("\n")) + "\n  ```\n")
        code, out = self.run_checker()
        self.assertEqual(code, 0, out)

    def test_repository_passes_and_an_altered_copy_fails(self):
        # This repository as it is: every README's snippets equal their sources.
        code, out = self.run_checker(REPO)
        self.assertEqual(code, 0, out)
        self.assertNotIn(" 0 snippet(s)", out)
        # A copy of the top README and its sources, one line of the quick start's region altered.
        copy = os.path.join(self.root, "copy")
        for rel in ["README.md", "examples/memory/memory_cpu.cpp", "examples/engine/gpu_seam.cu"]:
            os.makedirs(os.path.dirname(os.path.join(copy, rel)), exist_ok=True)
            shutil.copy(os.path.join(REPO, rel), os.path.join(copy, rel))
        code, out = self.run_checker(copy)
        self.assertEqual(code, 0, out)
        source = os.path.join(copy, "examples/memory/memory_cpu.cpp")
        with open(source, encoding="utf-8") as f:
            text = f.read()
        altered = text.replace("/*k*/ 2", "/*k*/ 3", 1)
        self.assertNotEqual(altered, text, "the quick start no longer asks for k = 2")
        with open(source, "w", encoding="utf-8") as f:
            f.write(altered)
        self.assert_fails("examples/memory/memory_cpu.cpp#quick_start differs", copy)


if __name__ == "__main__":
    unittest.main(verbosity=2)
