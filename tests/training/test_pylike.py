"""The Python-likeness measure: fragments of real statements parse, garbled lines do not, repeats are counted."""

from training.pylike import code_lines, line_parses, python_likeness


def test_fragments_of_real_statements_parse():
    for line in ["    parser.add_argument(", "        help='an integer', type=int,", "    else:", "    ])",
                 "    except ValueError as e:", "x = {1: (2,", "   d}), e)", "@property", '"""Docstring."""']:
        assert line_parses(line), line


def test_garbled_lines_do_not_parse():
    for line in ["b, filename=None, *, default=None, *, default=None,", "    return x + )", "def def x",
                 "The quick brown fox"]:
        assert not line_parses(line), line


def test_likeness_counts_complete_lines_and_repeats():
    text = "x = 1\n# comment\n\nx = 1\ndef def\ny = f(x)\nunfinished = ("
    assert code_lines(text) == ["x = 1", "x = 1", "def def", "y = f(x)"]
    assert python_likeness([text]) == {"lines": 4, "parse_rate": 0.75, "repeat_rate": 0.25}
