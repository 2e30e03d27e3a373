"""Human-readable formatting."""

_SYMBOLS = {"USD": "$"}


def format_money(money):
    """Format as "$1,234.56" / "-$5.00" for USD, "1,234.56 EUR" otherwise."""
    sign = "-" if money.cents < 0 else ""
    units, cents = divmod(abs(money.cents), 100)
    number = f"{units:,}.{cents:02d}"
    symbol = _SYMBOLS.get(money.currency)
    if symbol is not None:
        return f"{sign}{symbol}{number}"
    return f"{sign}{number} {money.currency}"
