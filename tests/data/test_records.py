"""Records: the orders a stage takes them in."""

from vlft.data.records import order_records


def test_orders_random_given_and_by_field():
    records = [{"id": str(i), "d": d} for i, d in enumerate([3, 1, 2, 1])]
    assert [r["id"] for r in order_records(records, "given", None, False, 0, 0)] == ["0", "1", "2", "3"]
    assert [r["id"] for r in order_records(records, "by_field", "d", False, 0, 0)] == ["1", "3", "2", "0"]
    assert [r["id"] for r in order_records(records, "by_field", "d", True, 0, 0)] == ["0", "2", "1", "3"]
    first, second = (order_records(records, "random", None, False, 7, e) for e in (0, 1))
    assert sorted(r["id"] for r in first) == ["0", "1", "2", "3"]
    assert order_records(records, "random", None, False, 7, 0) == first  # seeded
    assert first != second or first != order_records(records, "random", None, False, 7, 2)
