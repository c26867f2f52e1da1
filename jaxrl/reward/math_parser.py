"""Answers as sympy trees, read without ever evaluating text.

Safety: model outputs and dataset answers are untrusted. sympy's ``parse_expr`` evaluates
Python, so it is not used, nor is the optional ``math-verify`` package once tried first
(we cannot vouch that it never evaluates text). A whitelisting tokenizer and a
recursive-descent parser build sympy trees directly with ``evaluate=False`` (sympy's
auto-evaluation factors numbers under roots and runs assumption queries that can take
seconds); only rational arithmetic (``+ - * /``, integer powers) is folded, in ``Fraction``.

Accepted: numbers (``12``, ``0.5``, ``1.5e3``), ``+ - * / ^ **``, parentheses, postfix
``!``, implicit multiplication (``2x``, ``2(x+1)``, ``(x-1)(x+1)``, ``xy``), the functions
in ``_FUNCTIONS`` (``\\ln 2``, ``\\sin x`` need no parentheses; ``\\sin^2 x`` = (sin x)^2),
pi, e (Euler's), i (imaginary unit), infty/infinity/oo, and single-letter symbols (at most
3 per run of letters: ``banana`` is a word). Anything else (quotes, underscores, ``.``
after a name, ``[]``, commas, ``=``...) is not math: no match, score 0, ``unparsable=False``
-- text that is not a formula is an ordinary wrong answer.

Limits, checked before anything is computed, so no answer can hang the reward or exhaust
memory by itself (the worker-process timeout around rewards is only a second line):
``MAX_ANSWER_CHARS`` characters per answer; ``MAX_NESTING`` nested levels (parentheses,
signs, exponents, functions, ``!``: keeps all recursion far from Python's limit);
``MAX_NODES`` nodes; and ``MAX_DIGITS``: each node carries ``size``, an upper bound on
log10 of the numbers it holds (numerator plus denominator digits; a symbol counts log10 2,
as it is sampled with |x| <= 2). Sums and products add sizes; ``a^b`` has size(a) *
10**size(b), the digits of ``a`` times a bound on ``|b|``. ``2^{2023}`` (609 digits)
passes; ``9^9^9^9`` and ``10^{10^{10}}`` are refused from the sizes alone. An answer (the
model's or the reference) over a limit raises ``AnswerTooLarge``; the reward scores it 0
with ``unparsable=True``: it cannot be graded safely, so the trainer masks it rather than
calling it wrong.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import re
from fractions import Fraction
from typing import Callable

import sympy

MAX_NESTING = 32
MAX_NODES = 400
MAX_DIGITS = 5000
MAX_UNKNOWN_LETTERS = 3


class AnswerTooLarge(ValueError):
    """An answer exceeds a size limit (see the module docstring): it cannot be graded safely."""


class NotMath(ValueError):
    """The normalised answer is not an expression the parser accepts."""


_LOG10_2 = math.log10(2)
_LOG10_E = math.log10(math.e)


def _at_most_10_to(size: float) -> float:
    """10**size without OverflowError: the bound on |b| used for a power's size."""
    return math.inf if size > 300 else 10.0**size


def _power_size(base: float, exponent: float) -> float:
    return 0.0 if base == 0 else base * _at_most_10_to(exponent)  # base 0, +-1: 1^(10^100) is 1


def _argument_size(size: float) -> float:  # trig, roots: the value is small, the argument must be bounded
    return size + 1


def _exp_size(size: float) -> float:
    return _LOG10_E * _at_most_10_to(size)


def _log_size(size: float) -> float:
    return math.log10(size + 1) + 1


def _factorial_size(size: float) -> float:
    n = _at_most_10_to(size)
    return n * math.log10(n + 1) + 1


def _sqrt(argument: sympy.Expr, evaluate: bool) -> sympy.Expr:
    return sympy.Pow(argument, sympy.S.Half, evaluate=evaluate)


# name -> (sympy function, its size from its argument's size)
_FUNCTIONS: dict[str, tuple[Callable, Callable[[float], float]]] = {
    "sqrt": (_sqrt, _argument_size), "abs": (sympy.Abs, _argument_size),
    "sin": (sympy.sin, _argument_size), "cos": (sympy.cos, _argument_size), "tan": (sympy.tan, _argument_size),
    "cot": (sympy.cot, _argument_size), "sec": (sympy.sec, _argument_size), "csc": (sympy.csc, _argument_size),
    "arcsin": (sympy.asin, _argument_size), "arccos": (sympy.acos, _argument_size),
    "arctan": (sympy.atan, _argument_size), "asin": (sympy.asin, _argument_size),
    "acos": (sympy.acos, _argument_size), "atan": (sympy.atan, _argument_size),
    "tanh": (sympy.tanh, _argument_size), "sinh": (sympy.sinh, _exp_size), "cosh": (sympy.cosh, _exp_size),
    "exp": (sympy.exp, _exp_size), "log": (sympy.log, _log_size), "ln": (sympy.log, _log_size),
}
_CONSTANTS: dict[str, tuple[sympy.Expr, float]] = {
    "pi": (sympy.pi, math.log10(math.pi)), "e": (sympy.E, _LOG10_E), "E": (sympy.E, _LOG10_E),
    "i": (sympy.I, 0.0), "I": (sympy.I, 0.0),
    "infty": (sympy.oo, 1.0), "infinity": (sympy.oo, 1.0), "oo": (sympy.oo, 1.0),
}
_NAMES_LONGEST_FIRST = sorted([*_FUNCTIONS, *_CONSTANTS], key=len, reverse=True)
_TOKEN = re.compile(r"(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z]+)|(?P<op>\*\*|[-+*/^()!])")

Token = tuple[str, str]  # (kind, text); kind: num, func, const, sym, op


def _split_name(run: str) -> list[Token]:
    """A run of letters -> known names (longest first) and single-letter symbols."""
    tokens, i = [], 0
    while i < len(run):
        name = next((n for n in _NAMES_LONGEST_FIRST if run.startswith(n, i)), None)
        kind = "sym" if name is None else "func" if name in _FUNCTIONS else "const"
        tokens.append((kind, name or run[i]))
        i += len(name or run[i])
    if sum(kind == "sym" for kind, _ in tokens) > MAX_UNKNOWN_LETTERS:
        raise NotMath(f"{run!r} is a word, not a formula")
    return tokens


def _tokenize(text: str) -> list[Token]:
    """Whitelisted tokens only; any other character makes the text not math."""
    tokens: list[Token] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise NotMath(f"character {text[pos]!r} at {pos} is not accepted")
        kind, value = match.lastgroup, match.group()
        if kind == "num" and tokens and tokens[-1][0] == "num":
            raise NotMath(f"two numbers in a row near {pos} (like 1.2.3)")
        if kind == "name":
            tokens.extend(_split_name(value))
        else:
            tokens.append((kind, "^" if value == "**" else value))
        pos = match.end()
    return tokens


_EXACT = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "^": operator.pow}


def _flat(cls: type, a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    """a + b or a * b as one flat node: a chain of 200 terms is one level deep, not 200."""
    return cls(*(a.args if a.func is cls else (a,)), *(b.args if b.func is cls else (b,)), evaluate=False)


_SYMBOLIC = {
    "+": lambda a, b: _flat(sympy.Add, a, b),
    "-": lambda a, b: _flat(sympy.Add, a, sympy.Mul(-1, b, evaluate=False)),
    "*": lambda a, b: _flat(sympy.Mul, a, b),
    "/": lambda a, b: _flat(sympy.Mul, a, sympy.Pow(b, -1, evaluate=False)),
    "^": lambda a, b: sympy.Pow(a, b, evaluate=False),
}


@dataclasses.dataclass(frozen=True)
class _Node:
    expr: sympy.Expr
    size: float  # upper bound on log10 of the numbers it holds (module docstring)
    exact: Fraction | None = None  # its value, when it is a rational number


def _rational_node(value: Fraction, size: float) -> _Node:
    return _Node(sympy.Rational(value.numerator, value.denominator), size, value)


class _Parser:
    """Recursive descent over whitelisted tokens; each node's limits are checked before it is built.

    sum     := product (('+'|'-') product)*
    product := signed (('*'|'/') signed | power)*      (a bare power: implicit multiplication)
    signed  := ('+'|'-') signed | power
    power   := postfix ('^' signed)?                   (right-associative: 2^3^2 = 2^9)
    postfix := atom '!'*
    atom    := number | const | symbol | '(' sum ')' | func ('^' signed)? ('(' sum ')' | power)
    """

    def __init__(self, text: str):
        self.tokens = _tokenize(text)
        self.pos = 0
        self.nesting = 0
        self.nodes = 0

    def parse(self) -> sympy.Expr:
        node = self._sum()
        if self.pos != len(self.tokens):
            raise NotMath(f"unexpected {self.tokens[self.pos][1]!r}")
        return node.expr

    def _peek(self) -> Token | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> Token:
        token = self._peek()
        if token is None:
            raise NotMath("the expression ends early")
        self.pos += 1
        return token

    def _admit(self, size: float) -> float:
        """Counts a new node and checks its size, before anything is computed for it."""
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise AnswerTooLarge(f"more than {MAX_NODES} nodes")
        if not size <= MAX_DIGITS:  # `not <=` also refuses nan
            raise AnswerTooLarge(f"a number could need more than {MAX_DIGITS} digits")
        return size

    def _binary(self, op: str, left: _Node, right: _Node) -> _Node:
        if op == "^":
            size = self._admit(_power_size(left.size, right.size))
        else:
            size = self._admit(left.size + right.size + (_LOG10_2 if op in "+-" else 0))
        exact = None
        if left.exact is not None and right.exact is not None and (op != "^" or right.exact.denominator == 1):
            try:  # bounded by the size just checked
                exact = _EXACT[op](left.exact, right.exact)
            except ZeroDivisionError:  # 1/0 stays symbolic; it has no value, so it matches nothing
                pass
        if exact is not None:
            return _rational_node(exact, size)
        return _Node(_SYMBOLIC[op](left.expr, right.expr), size)

    def _sum(self) -> _Node:
        node = self._product()
        while self._peek() in (("op", "+"), ("op", "-")):
            op = self._take()[1]
            node = self._binary(op, node, self._product())
        return node

    def _product(self) -> _Node:
        node = self._signed()
        while True:
            token = self._peek()
            if token in (("op", "*"), ("op", "/")):
                self._take()
                node = self._binary(token[1], node, self._signed())
            elif token is not None and (token[0] != "op" or token[1] == "("):  # 2x, 2(x+1), (x-1)(x+1)
                node = self._binary("*", node, self._power())
            else:
                return node

    @contextlib.contextmanager
    def _nested(self):
        """One level deeper: bounds the parser's recursion and the depth of the tree it builds."""
        self.nesting += 1
        if self.nesting > MAX_NESTING:
            raise AnswerTooLarge(f"more than {MAX_NESTING} nested levels")
        try:
            yield
        finally:
            self.nesting -= 1

    def _signed(self) -> _Node:
        with self._nested():
            token = self._peek()
            if token not in (("op", "+"), ("op", "-")):
                return self._power()
            self._take()
            inner = self._signed()
            return inner if token[1] == "+" else self._binary("*", _rational_node(Fraction(-1), 0.0), inner)

    def _power(self) -> _Node:
        base = self._postfix()
        if self._peek() != ("op", "^"):
            return base
        self._take()
        return self._binary("^", base, self._signed())

    def _postfix(self) -> _Node:
        node = self._atom()
        with contextlib.ExitStack() as levels:
            while self._peek() == ("op", "!"):  # x!!!: each ! is one level deeper in the tree
                self._take()
                levels.enter_context(self._nested())
                node = _Node(sympy.factorial(node.expr, evaluate=False), self._admit(_factorial_size(node.size)))
        return node

    def _atom(self) -> _Node:
        kind, text = self._take()
        if kind == "num":
            return self._number(text)
        if kind == "sym":
            return _Node(sympy.Symbol(text), self._admit(_LOG10_2))
        if kind == "const":
            expr, size = _CONSTANTS[text]
            return _Node(expr, self._admit(size))
        if kind == "func":
            return self._call(text)
        if text == "(":
            inner = self._sum()
            if self._take() != ("op", ")"):
                raise NotMath("unbalanced parentheses")
            return inner
        raise NotMath(f"unexpected {text!r}")

    def _number(self, text: str) -> _Node:
        _, _, exponent = text.lower().partition("e")
        if exponent and abs(int(exponent)) > MAX_DIGITS:  # before Fraction builds 10**exponent
            raise AnswerTooLarge(f"{text[:40]!r} has more than {MAX_DIGITS} digits")
        value = Fraction(text)
        size = math.log10(max(abs(value.numerator), 1)) + math.log10(value.denominator)
        return _rational_node(value, self._admit(size))

    def _call(self, name: str) -> _Node:
        function, size_of = _FUNCTIONS[name]
        with self._nested():  # \sin\sin\sin x nests without parentheses
            power = None
            if self._peek() == ("op", "^"):  # \sin^2 x = (sin x)^2
                self._take()
                power = self._signed()
                if power.exact == -1:
                    raise NotMath(f"{name}^-1 is ambiguous (inverse or reciprocal)")
            # f(x)^2 is (f x)^2: a parenthesised argument is an atom, the caller takes the power.
            argument = self._atom() if self._peek() == ("op", "(") else self._power()
            node = _Node(function(argument.expr, evaluate=False), self._admit(size_of(argument.size)))
            return node if power is None else self._binary("^", node, power)


def parse_answer(normalised: str) -> sympy.Expr:
    """The sympy tree of a normalised answer. Raises NotMath or AnswerTooLarge; never evaluates text."""
    if not normalised:
        raise NotMath("empty answer")
    return _Parser(normalised).parse()
