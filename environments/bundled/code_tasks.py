"""The function-writing tasks of code_exec: a signature with its docstring, hidden asserts, a solution."""

from __future__ import annotations

# id, the stub the model sees, the asserts it does not see (each one test), a solution that passes them.
TASKS: list[dict] = [
    {
        "id": "add",
        "stub": 'def add(a, b):\n    """Return the sum of a and b."""',
        "tests": ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(2.5, 0.5) == 3.0"],
        "solution": "def add(a, b):\n    return a + b",
    },
    {
        "id": "reverse_words",
        "stub": 'def reverse_words(text):\n    """Return the words of text (split on whitespace) in reverse order, joined by single spaces."""',
        "tests": [
            "assert reverse_words('a b c') == 'c b a'",
            "assert reverse_words('  hello   world ') == 'world hello'",
            "assert reverse_words('') == ''",
        ],
        "solution": "def reverse_words(text):\n    return ' '.join(reversed(text.split()))",
    },
    {
        "id": "is_palindrome",
        "stub": 'def is_palindrome(text):\n    """True if text reads the same backwards, ignoring case and non-alphanumeric characters."""',
        "tests": [
            "assert is_palindrome('A man, a plan, a canal: Panama')",
            "assert not is_palindrome('abc')",
            "assert is_palindrome('')",
            "assert is_palindrome('No lemon, no melon')",
        ],
        "solution": "def is_palindrome(text):\n    kept = [c.lower() for c in text if c.isalnum()]\n    return kept == kept[::-1]",
    },
    {
        "id": "fizzbuzz",
        "stub": 'def fizzbuzz(n):\n    """Return "Fizz" for multiples of 3, "Buzz" of 5, "FizzBuzz" of both, else str(n)."""',
        "tests": [
            "assert fizzbuzz(3) == 'Fizz'",
            "assert fizzbuzz(10) == 'Buzz'",
            "assert fizzbuzz(30) == 'FizzBuzz'",
            "assert fizzbuzz(7) == '7'",
        ],
        "solution": "def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n        return 'Fizz'\n"
        "    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)",
    },
    {
        "id": "fibonacci",
        "stub": 'def fibonacci(n):\n    """Return the n-th Fibonacci number, fibonacci(0) == 0 and fibonacci(1) == 1."""',
        "tests": [
            "assert fibonacci(0) == 0",
            "assert fibonacci(1) == 1",
            "assert fibonacci(10) == 55",
            "assert fibonacci(90) == 2880067194370816120",
        ],
        "solution": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    },
    {
        "id": "count_vowels",
        "stub": 'def count_vowels(text):\n    """Return how many characters of text are vowels (a, e, i, o, u, either case)."""',
        "tests": [
            "assert count_vowels('Hello World') == 3",
            "assert count_vowels('xyz') == 0",
            "assert count_vowels('AEIOU') == 5",
        ],
        "solution": "def count_vowels(text):\n    return sum(c in 'aeiouAEIOU' for c in text)",
    },
    {
        "id": "flatten",
        "stub": 'def flatten(nested):\n    """Return the items of arbitrarily nested lists as one flat list, in order."""',
        "tests": [
            "assert flatten([1, [2, [3, 4]], 5]) == [1, 2, 3, 4, 5]",
            "assert flatten([]) == []",
            "assert flatten([[[]], [1]]) == [1]",
        ],
        "solution": "def flatten(nested):\n    out = []\n    for item in nested:\n"
        "        out.extend(flatten(item) if isinstance(item, list) else [item])\n    return out",
    },
    {
        "id": "is_prime",
        "stub": 'def is_prime(n):\n    """True if the integer n is a prime number."""',
        "tests": [
            "assert is_prime(2) and is_prime(97)",
            "assert not is_prime(1) and not is_prime(0)",
            "assert not is_prime(91)",
            "assert is_prime(1_000_003)",
        ],
        "solution": "def is_prime(n):\n    if n < 2:\n        return False\n    d = 2\n    while d * d <= n:\n"
        "        if n % d == 0:\n            return False\n        d += 1\n    return True",
    },
    {
        "id": "word_counts",
        "stub": 'def word_counts(text):\n    """Return a dict of each lowercased whitespace-separated word of text to how often it occurs."""',
        "tests": ["assert word_counts('a B a') == {'a': 2, 'b': 1}", "assert word_counts('') == {}"],
        "solution": "def word_counts(text):\n    counts = {}\n    for word in text.lower().split():\n"
        "        counts[word] = counts.get(word, 0) + 1\n    return counts",
    },
    {
        "id": "second_largest",
        "stub": 'def second_largest(numbers):\n    """Return the second largest distinct value of numbers, or None if there is none."""',
        "tests": [
            "assert second_largest([3, 1, 4, 1, 5]) == 4",
            "assert second_largest([2, 2]) is None",
            "assert second_largest([-1, -2]) == -2",
        ],
        "solution": "def second_largest(numbers):\n    distinct = sorted(set(numbers))\n    return distinct[-2] if len(distinct) > 1 else None",
    },
    {
        "id": "run_length",
        "stub": 'def run_length(text):\n    """Return the run-length encoding of text: "aaab" -> "a3b1"."""',
        "tests": [
            "assert run_length('aaab') == 'a3b1'",
            "assert run_length('') == ''",
            "assert run_length('abc') == 'a1b1c1'",
        ],
        "solution": "def run_length(text):\n    out, i = [], 0\n    while i < len(text):\n        j = i\n"
        "        while j < len(text) and text[j] == text[i]:\n            j += 1\n"
        "        out.append(f'{text[i]}{j - i}')\n        i = j\n    return ''.join(out)",
    },
    {
        "id": "balanced",
        "stub": 'def balanced(text):\n    """True if the brackets ()[]{} in text are balanced and properly nested."""',
        "tests": [
            "assert balanced('([]{})')",
            "assert not balanced('(]')",
            "assert not balanced('((')",
            "assert balanced('a(b)c')",
        ],
        "solution": "def balanced(text):\n    pairs, stack = {')': '(', ']': '[', '}': '{'}, []\n    for c in text:\n"
        "        if c in '([{':\n            stack.append(c)\n        elif c in pairs:\n"
        "            if not stack or stack.pop() != pairs[c]:\n                return False\n    return not stack",
    },
    {
        "id": "merge_sorted",
        "stub": 'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""',
        "tests": [
            "assert merge_sorted([1, 3], [2, 4]) == [1, 2, 3, 4]",
            "assert merge_sorted([], [1]) == [1]",
            "assert merge_sorted([1, 1], [1]) == [1, 1, 1]",
        ],
        "solution": "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
        "            out.append(b[j])\n            j += 1\n    return out + a[i:] + b[j:]",
    },
    {
        "id": "digit_sum",
        "stub": 'def digit_sum(n):\n    """Return the sum of the decimal digits of the integer n (its sign ignored)."""',
        "tests": ["assert digit_sum(1234) == 10", "assert digit_sum(-56) == 11", "assert digit_sum(0) == 0"],
        "solution": "def digit_sum(n):\n    return sum(int(d) for d in str(abs(n)))",
    },
    {
        "id": "transpose",
        "stub": 'def transpose(matrix):\n    """Return the transpose of a rectangular list-of-lists matrix."""',
        "tests": ["assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]", "assert transpose([]) == []"],
        "solution": "def transpose(matrix):\n    return [list(row) for row in zip(*matrix)]",
    },
    {
        "id": "caesar",
        "stub": 'def caesar(text, shift):\n    """Shift each ASCII letter of text by shift places in the alphabet, '
        'keeping case; other characters stay."""',
        "tests": [
            "assert caesar('abc', 1) == 'bcd'",
            "assert caesar('XyZ', 3) == 'AbC'",
            "assert caesar('a-b!', -1) == 'z-a!'",
        ],
        "solution": "def caesar(text, shift):\n    out = []\n    for c in text:\n        if c.isascii() and c.isalpha():\n"
        "            base = ord('a') if c.islower() else ord('A')\n            c = chr((ord(c) - base + shift) % 26 + base)\n"
        "        out.append(c)\n    return ''.join(out)",
    },
]
