"""The demo's built-in questions: used when the Spider trace is not available.

Twelve Spider-style questions over three small schemas written for this
package (``library``, ``shop``, ``school``).  The schemas use the layout of
the Spider trace's prompts (``CREATE TABLE`` statements with ``PRIMARY KEY``
/ ``FOREIGN KEY`` clauses), so the text-to-SQL pipeline treats them exactly
like Spider questions.  Questions on the same database come in runs, as in
Spider's dev set, which is what lets stage shards learn from earlier answers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUILTIN_SCHEMAS", "BuiltinQuestion", "builtin_questions"]

_LIBRARY = """CREATE TABLE author (
  Author_ID NUMBER,
  Name TEXT,
  Country TEXT,
  Birth_Year NUMBER,
  PRIMARY KEY (Author_ID)
);

CREATE TABLE book (
  Book_ID NUMBER,
  Title TEXT,
  Author_ID NUMBER,
  Genre TEXT,
  Pages NUMBER,
  Published_Year NUMBER,
  PRIMARY KEY (Book_ID),
  FOREIGN KEY (Author_ID) REFERENCES author(Author_ID)
);

CREATE TABLE member (
  Member_ID NUMBER,
  Name TEXT,
  City TEXT,
  Joined_Year NUMBER,
  PRIMARY KEY (Member_ID)
);

CREATE TABLE loan (
  Loan_ID NUMBER,
  Book_ID NUMBER,
  Member_ID NUMBER,
  Loan_Date TEXT,
  Returned TEXT,
  PRIMARY KEY (Loan_ID),
  FOREIGN KEY (Book_ID) REFERENCES book(Book_ID),
  FOREIGN KEY (Member_ID) REFERENCES member(Member_ID)
);"""

_SHOP = """CREATE TABLE customer (
  Customer_ID NUMBER,
  Name TEXT,
  Email TEXT,
  City TEXT,
  PRIMARY KEY (Customer_ID)
);

CREATE TABLE product (
  Product_ID NUMBER,
  Name TEXT,
  Category TEXT,
  Price NUMBER,
  PRIMARY KEY (Product_ID)
);

CREATE TABLE orders (
  Order_ID NUMBER,
  Customer_ID NUMBER,
  Order_Date TEXT,
  Status TEXT,
  PRIMARY KEY (Order_ID),
  FOREIGN KEY (Customer_ID) REFERENCES customer(Customer_ID)
);

CREATE TABLE order_item (
  Order_ID NUMBER,
  Product_ID NUMBER,
  Quantity NUMBER,
  PRIMARY KEY (Order_ID, Product_ID),
  FOREIGN KEY (Order_ID) REFERENCES orders(Order_ID),
  FOREIGN KEY (Product_ID) REFERENCES product(Product_ID)
);"""

_SCHOOL = """CREATE TABLE student (
  Student_ID NUMBER,
  Name TEXT,
  Age NUMBER,
  Major TEXT,
  PRIMARY KEY (Student_ID)
);

CREATE TABLE course (
  Course_ID NUMBER,
  Title TEXT,
  Department TEXT,
  Credits NUMBER,
  PRIMARY KEY (Course_ID)
);

CREATE TABLE enrollment (
  Student_ID NUMBER,
  Course_ID NUMBER,
  Grade TEXT,
  PRIMARY KEY (Student_ID, Course_ID),
  FOREIGN KEY (Student_ID) REFERENCES student(Student_ID),
  FOREIGN KEY (Course_ID) REFERENCES course(Course_ID)
);"""

#: The built-in databases: ``db_id -> CREATE TABLE statements``.
BUILTIN_SCHEMAS: dict[str, str] = {"library": _LIBRARY, "shop": _SHOP, "school": _SCHOOL}

_QUESTIONS: tuple[tuple[str, str], ...] = (
    ("library", "How many books are there?"),
    ("library", "List the titles of all books with more than 300 pages."),
    ("library", "What is the name of the author of the book titled 'Dune'?"),
    ("library", "How many books has each author written? Show the author name and the count."),
    ("shop", "How many customers are there?"),
    ("shop", "What are the names and prices of products in the category 'Books'?"),
    ("shop", "What is the average price of all products?"),
    ("shop", "Show the names of customers who placed an order with status 'shipped'."),
    ("school", "How many students are there?"),
    ("school", "List the names and ages of students ordered by age from the oldest."),
    ("school", "What is the title of the course with the most credits?"),
    ("school", "How many students are enrolled in each department? Show department and count."),
)


@dataclass(frozen=True)
class BuiltinQuestion:
    """One built-in question: its session id, database id, text and schema."""

    session: str
    db_id: str
    question: str
    schema: str


def builtin_questions(limit: int | None = None) -> list[BuiltinQuestion]:
    """The built-in questions in order (the first ``limit`` of them when given).

    Raises:
        ValueError: ``limit`` is negative.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    picked = _QUESTIONS if limit is None else _QUESTIONS[:limit]
    return [
        BuiltinQuestion(f"builtin-{i}", db, text, BUILTIN_SCHEMAS[db])
        for i, (db, text) in enumerate(picked)
    ]
