"""Filled-in values outside a PDF page's content (`infokv_rag.pdf_forms`): what counts, and odd input survived.
How they read in a loaded document: tests/test_documents.py, test_a_filled_in_forms_values_are_read_beside_their_labels.
"""

from __future__ import annotations

from pypdf import PageObject, PdfWriter
from pypdf.generic import (
    ArrayObject,
    ByteStringObject,
    DictionaryObject,
    FloatObject,
    NameObject,
    NumberObject,
    TextStringObject,
)

from infokv_rag.pdf_forms import Filled, Fragment, filled_values, page_text, with_filled_values


def _dictionary(**entries: object) -> DictionaryObject:
    return DictionaryObject({NameObject(f"/{key}"): value for key, value in entries.items()})


def _rect(*numbers: float) -> ArrayObject:
    return ArrayObject(FloatObject(number) for number in numbers)


def _page_with(writer: PdfWriter, *annotations: DictionaryObject) -> PageObject:
    page = writer.add_blank_page(612, 792)
    page[NameObject("/Annots")] = ArrayObject(writer._add_object(annotation) for annotation in annotations)
    return page


def test_only_values_a_reader_sees_count() -> None:
    writer = PdfWriter()
    parent = _dictionary(FT=NameObject("/Tx"), T=TextStringObject("fees"), V=TextStringObject("USD 900"))
    kid = _dictionary(Subtype=NameObject("/Widget"), Rect=_rect(300, 100, 400, 118))
    kid[NameObject("/Parent")] = writer._add_object(parent)
    page = _page_with(
        writer,
        kid,  # its value and kind are its field's
        _dictionary(
            Subtype=NameObject("/Widget"), FT=NameObject("/Btn"), Ff=NumberObject(1 << 16), Rect=_rect(0, 0, 9, 9)
        ),
        _dictionary(
            Subtype=NameObject("/Widget"), FT=NameObject("/Sig"), V=TextStringObject("x"), Rect=_rect(0, 0, 9, 9)
        ),
        _dictionary(
            Subtype=NameObject("/Widget"), FT=NameObject("/Tx"), V=TextStringObject("  "), Rect=_rect(0, 0, 9, 9)
        ),
        _dictionary(Subtype=NameObject("/Link"), Rect=_rect(0, 0, 9, 9)),
        _dictionary(Subtype=NameObject("/Widget"), FT=NameObject("/Tx"), V=TextStringObject("no box")),
        _dictionary(
            Subtype=NameObject("/Widget"), FT=NameObject("/Tx"), V=TextStringObject("bad box"), Rect=_rect(1, 2)
        ),
        # What a viewer never shows: a hidden field (a form's working value) and a note flagged no-view.
        _dictionary(
            Subtype=NameObject("/Widget"),
            FT=NameObject("/Tx"),
            V=TextStringObject("hidden"),
            F=NumberObject(2),
            Rect=_rect(0, 0, 9, 9),
        ),
        _dictionary(
            Subtype=NameObject("/FreeText"),
            Contents=TextStringObject("no view"),
            F=NumberObject(32),
            Rect=_rect(0, 0, 9, 9),
        ),
    )
    assert filled_values(page) == [Filled("USD 900", (300.0, 100.0, 400.0, 118.0), "fees")]
    assert page_text(page) == "fees: USD 900"  # a page whose content has no text keeps its values all the same


def test_a_cycle_of_parents_and_odd_entries_are_survived() -> None:
    writer = PdfWriter()
    first = _dictionary(Subtype=NameObject("/Widget"), Rect=_rect(0, 0, 9, 9), T=TextStringObject("a"))
    second = _dictionary(T=TextStringObject("b"))
    first_ref, second_ref = writer._add_object(first), writer._add_object(second)
    first[NameObject("/Parent")] = second_ref
    second[NameObject("/Parent")] = first_ref
    page = writer.add_blank_page(612, 792)
    page[NameObject("/Annots")] = ArrayObject([first_ref, NumberObject(3), NameObject("/Junk")])
    assert filled_values(page) == []  # no kind anywhere up the cycle: not a field a value can be read from
    page[NameObject("/Annots")] = NameObject("/NotAnArray")
    assert filled_values(page) == []


def test_choices_show_their_display_text_and_lists_their_choices() -> None:
    writer = PdfWriter()
    options = ArrayObject(
        [
            ArrayObject([TextStringObject("g"), TextStringObject("Gold")]),
            ArrayObject([TextStringObject("s"), TextStringObject("Silver")]),
        ]
    )
    page = _page_with(
        writer,
        _dictionary(
            Subtype=NameObject("/Widget"),
            FT=NameObject("/Ch"),
            V=TextStringObject("g"),
            Opt=options,
            Rect=_rect(0, 50, 9, 59),
        ),
        _dictionary(
            Subtype=NameObject("/Widget"),
            FT=NameObject("/Ch"),
            V=ArrayObject([TextStringObject("g"), TextStringObject("s")]),
            Opt=options,
            Rect=_rect(0, 0, 9, 9),
        ),
    )
    assert [value.text for value in filled_values(page)] == ["Gold", "Gold, Silver"]


def test_a_label_that_cannot_be_found_in_the_text_leaves_the_value_at_the_end() -> None:
    fragments = [Fragment("Fee:", 72, 700), Fragment("ghost", 72, 650)]
    values = [Filled("USD 5", (120, 695, 200, 713), "fee"), Filled("10 days", (120, 645, 200, 663), "notice")]
    assert (
        with_filled_values("Fee:\nsomething else", fragments, values) == "Fee: USD 5\nsomething else\nnotice: 10 days"
    )


def test_a_boxed_forms_values_follow_their_own_captions() -> None:
    """Cells in a row, each with a caption in (or just on) the top of its box: the previous cell's caption is
    nearer on the left, but the value is its own cell's."""
    fragments = [Fragment("Last name", 72, 712), Fragment("First name", 202, 722)]  # in its box; 2 pt above it
    values = [Filled("Whitcombe", (70, 700, 200, 720), "last"), Filled("Dana", (200, 700, 330, 720), "first")]
    assert with_filled_values("Last name First name", fragments, values) == "Last name Whitcombe First name Dana"


def test_the_label_left_of_another_field_is_not_this_ones() -> None:
    """A row of two fields: "Customer:" left of the first, "Start date" just above the second. The text nearest on
    the second's left is the first field's label: the start date went after the customer's name, its own label
    left empty."""
    fragments = [Fragment("Customer:", 72, 700), Fragment("Start date", 340, 718)]
    values = [
        Filled("Northwind Traders Ltd", (140, 695, 300, 713), "customer"),
        Filled("1 March 2026", (340, 695, 460, 713), "start"),
    ]
    assert with_filled_values("Customer:\nStart date", fragments, values) == (
        "Customer: Northwind Traders Ltd\nStart date 1 March 2026"
    )


def test_a_value_the_content_also_draws_in_its_box_is_not_repeated() -> None:
    """A form flattened but kept: the content draws each value in the value's box, line by line or word by word,
    perhaps under a caption in the top of the box."""
    address = Filled("12 Main St\nSpringfield", (160, 705, 360, 745), "address")
    by_line = [Fragment("Address:", 72, 730), Fragment("12 Main St", 162, 730), Fragment("Springfield", 162, 716)]
    assert with_filled_values("Address:\n12 Main St\nSpringfield", by_line, [address]) == (
        "Address:\n12 Main St\nSpringfield"
    )
    captioned = [Fragment("Address", 162, 738), Fragment("12 Main St", 162, 724), Fragment("Springfield", 162, 710)]
    assert with_filled_values("Address\n12 Main St\nSpringfield", captioned, [address]) == (
        "Address\n12 Main St\nSpringfield"
    )
    fee = Filled("USD 7,400", (160, 725, 310, 743), "fee")
    by_word = [Fragment("Fee:", 72, 730), Fragment("USD", 162, 730), Fragment(" 7,400", 185, 730)]
    assert with_filled_values("Fee:\nUSD 7,400", by_word, [fee]) == "Fee:\nUSD 7,400"
    # Only part of the value drawn in its box: the value is still read.
    partly = [Fragment("Address:", 72, 730), Fragment("12 Main St", 162, 730)]
    assert (
        with_filled_values("Address:\n12 Main St", partly, [address]) == "Address:\n12 Main St 12 Main St\nSpringfield"
    )


def test_values_in_bytes_referenced_states_and_rich_text_are_read() -> None:
    writer = PdfWriter()
    state = writer._add_object(NameObject("/Yes"))
    rich = TextStringObject("<body><p>Dana <b>Whitcombe</b> &amp; Co</p></body>")
    page = _page_with(
        writer,
        _dictionary(
            Subtype=NameObject("/Widget"),
            FT=NameObject("/Tx"),
            V=ByteStringObject("Hauptstraße 5".encode()),
            Rect=_rect(0, 90, 9, 99),
        ),
        _dictionary(Subtype=NameObject("/Widget"), FT=NameObject("/Btn"), AS=state, Rect=_rect(0, 50, 9, 59)),
        _dictionary(Subtype=NameObject("/FreeText"), RC=rich, Rect=_rect(0, 0, 9, 9)),
    )
    assert [value.shown for value in filled_values(page)] == ["Hauptstraße 5", "[x]", "Dana Whitcombe & Co"]


def test_radio_buttons_without_a_state_of_their_own_are_on_only_for_the_fields_value() -> None:
    writer = PdfWriter()
    group = writer._add_object(_dictionary(FT=NameObject("/Btn"), Ff=NumberObject(1 << 15), V=NameObject("/annual")))
    kids = []
    for choice, y in (("/annual", 50), ("/monthly", 0)):
        appearance = _dictionary(
            N=DictionaryObject({NameObject(choice): NumberObject(0), NameObject("/Off"): NumberObject(0)})
        )
        kid = _dictionary(Subtype=NameObject("/Widget"), AP=appearance, Rect=_rect(0, y, 9, y + 9))
        kid[NameObject("/Parent")] = group
        kids.append(kid)
    assert [value.shown for value in filled_values(_page_with(writer, *kids))] == ["[x]", "[ ]"]


def test_a_right_to_left_forms_values_follow_the_labels_on_their_right() -> None:
    """In Hebrew or Arabic a label stands right of its box; to the box's left is the next field's label. Every value
    went to the end of the page under its field's name, or after the wrong label."""
    fragments = [Fragment("דמי מנוי חודשיים:", 430, 730), Fragment("תאריך התחלה:", 200, 730)]
    values = [Filled("USD 7,400", (300, 725, 420, 743), "fee"), Filled("1.3.2026", (70, 725, 190, 743), "start")]
    assert with_filled_values("דמי מנוי חודשיים: תאריך התחלה:", fragments, values) == (
        "דמי מנוי חודשיים: USD 7,400 תאריך התחלה: 1.3.2026"
    )
    arabic = [Fragment("الرسوم الشهرية:", 430, 730)]
    assert with_filled_values("الرسوم الشهرية:", arabic, values[:1]) == "الرسوم الشهرية: USD 7,400"
