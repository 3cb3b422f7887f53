"""Shop: a product catalogue, a cart with coupon and shipping rules, and an irreversible checkout."""

from __future__ import annotations

import random
from typing import Any

from envace.envs._common import Script, World, arg, lookup, money, next_id, ordered
from envace.envs.base import WORLDS, ToolError, tool
from envace.types import Task

COUPONS = {"SAVE10": {"min": 50, "percent": 10}, "FLAT5": {"min": 20, "off": 5}}
SHIPPING, FREE_SHIPPING_FROM = 5, 50
PRODUCTS = {
    "kitchen": ("mug", "kettle", "plate", "bowl", "spoon"),
    "home": ("lamp", "pillow", "towel", "candle", "rug"),
    "office": ("pen", "stapler", "notebook", "chair", "desk"),
}


def discount(code: str | None, subtotal: float) -> int | float:
    """A coupon whose minimum the subtotal no longer reaches gives nothing."""
    rule = COUPONS.get(code or "")
    if rule is None or subtotal < rule["min"]:
        return 0
    return money(subtotal * rule.get("percent", 0) / 100 + rule.get("off", 0))


@WORLDS.register("shop")
class Shop(World):
    name = "shop"
    description = (
        "Online shop. Product ids are P<n>; order ids are O<n>, numbered from 1 in checkout order. "
        "search_products matches the query (case-insensitive) inside product names and categories and "
        "lists matches by id. add_to_cart fails with OUT_OF_STOCK when the cart would hold more than the stock. "
        "Coupons: SAVE10 = 10% off the subtotal, needs subtotal >= 50; FLAT5 = 5 off, needs subtotal >= 20. "
        "apply_coupon gives COUPON_NOT_APPLICABLE below the minimum and INVALID_COUPON for other codes; "
        "a new coupon replaces the old one, and a coupon gives 0 once the subtotal falls below its minimum. "
        "Shipping is 5, free when subtotal - discount >= 50 or the cart is empty. total = subtotal - discount + shipping, "
        "rounded to cents. add_to_cart and apply_coupon return the cart like view_cart. checkout places the order "
        "(EMPTY_CART if empty), takes the items out of stock and empties the cart; it cannot be undone. "
        "Unknown ids give NOT_FOUND."
    )
    irreversible_tools = frozenset({"checkout"})

    def default_state(self) -> dict[str, Any]:
        return {"products": {}, "cart": {}, "coupon": None, "orders": {}}

    @tool("Find products whose name or category contains the query.", {"query": arg("string")}, ["query"])
    def search_products(self, query: str) -> dict[str, Any]:
        q = query.lower()
        hits = [pid for pid, p in ordered(self.state["products"]) if q in p["name"].lower() or q in p["category"].lower()]
        return {"products": [self.get_product(pid) for pid in hits]}

    @tool("Details and stock of one product.", {"product_id": arg("string", "e.g. P3")}, ["product_id"])
    def get_product(self, product_id: str) -> dict[str, Any]:
        return {"id": product_id, **lookup(self.state["products"], product_id, "product")}

    @tool("Add units of a product to the cart.", {"product_id": arg("string"), "quantity": arg("integer", minimum=1)},
          ["product_id", "quantity"])
    def add_to_cart(self, product_id: str, quantity: int) -> dict[str, Any]:
        product = lookup(self.state["products"], product_id, "product")
        wanted = self.state["cart"].get(product_id, 0) + quantity
        if wanted > product["stock"]:
            raise ToolError("OUT_OF_STOCK", f"{product_id} has {product['stock']} in stock; the cart would hold {wanted}")
        self.state["cart"][product_id] = wanted
        return self.view_cart()

    @tool("Apply a coupon code to the cart.", {"code": arg("string")}, ["code"])
    def apply_coupon(self, code: str) -> dict[str, Any]:
        if code not in COUPONS:
            raise ToolError("INVALID_COUPON", f"unknown coupon {code!r}")
        subtotal = self.view_cart()["subtotal"]
        if subtotal < COUPONS[code]["min"]:
            raise ToolError("COUPON_NOT_APPLICABLE", f"{code} needs subtotal >= {COUPONS[code]['min']}; subtotal is {subtotal}")
        self.state["coupon"] = code
        return self.view_cart()

    @tool("Show the cart: items, subtotal, discount, shipping and total.")
    def view_cart(self) -> dict[str, Any]:
        products = self.state["products"]
        items = [{"id": pid, "name": products[pid]["name"], "price": products[pid]["price"], "qty": qty}
                 for pid, qty in ordered(self.state["cart"])]
        subtotal = money(sum(i["price"] * i["qty"] for i in items))
        off = discount(self.state["coupon"], subtotal)
        shipping = 0 if not items or subtotal - off >= FREE_SHIPPING_FROM else SHIPPING
        return {"coupon": self.state["coupon"], "discount": off, "items": items, "shipping": shipping,
                "subtotal": subtotal, "total": money(subtotal - off + shipping)}

    @tool("Place the order for the whole cart. Cannot be undone.")
    def checkout(self) -> dict[str, Any]:
        cart = self.view_cart()
        if not cart["items"]:
            raise ToolError("EMPTY_CART", "the cart is empty")
        for item in cart["items"]:
            self.state["products"][item["id"]]["stock"] -= item["qty"]
        order_id = next_id(self.state["orders"], "O")
        self.state["orders"][order_id] = {"coupon": cart["coupon"], "items": dict(self.state["cart"]), "total": cart["total"]}
        self.state["cart"], self.state["coupon"] = {}, None
        return {"order_id": order_id, "total": cart["total"]}

    @classmethod
    def facts(cls, state: dict[str, Any]) -> str:
        catalogue = "; ".join(f"{pid} {p['name']} ({p['category']}) price {p['price']} stock {p['stock']}"
                              for pid, p in ordered(state["products"]))
        cart = ", ".join(f"{qty} x {pid}" for pid, qty in ordered(state["cart"])) or "empty"
        return f"Catalogue: {catalogue}. Cart: {cart}. Orders so far: {len(state['orders'])}."


# ---- task families -------------------------------------------------------------------------

def _start(rng: random.Random, n: int) -> Script:
    """A fresh shop with n products: distinct prices (whole or .5) so 'cheapest' is unambiguous."""
    picks = rng.sample([(name, cat) for cat, names in PRODUCTS.items() for name in names], n)
    prices = rng.sample(range(6, 120), n)
    products = {f"P{i}": {"category": cat, "name": name, "price": money(price / 2), "stock": rng.randint(1, 5)}
                for i, ((name, cat), price) in enumerate(zip(picks, prices), 1)}
    return Script(Shop, {"products": products, "cart": {}, "coupon": None, "orders": {}})


def _fill(rng: random.Random, s: Script, n_items: int) -> tuple[str, dict[str, Any]]:
    """Reference steps: search each wanted product by name, then add it. Returns (request words, cart)."""
    wanted = [(p["name"], rng.randint(1, p["stock"])) for p in rng.sample(list(s.initial["products"].values()), n_items)]
    cart: dict[str, Any] = {}
    for name, qty in wanted:
        hit = next(p for p in s("search_products", query=name)["products"] if p["name"] == name)
        cart = s("add_to_cart", product_id=hit["id"], quantity=qty)
    return " and ".join(f"{qty} x {name}" for name, qty in wanted), cart


def _coupon_if_it_applies(s: Script, code: str, cart: dict[str, Any]) -> dict[str, Any]:
    return s("apply_coupon", code=code) if cart["subtotal"] >= COUPONS[code]["min"] else cart


def buy(rng: random.Random, difficulty: int) -> Task:
    s = _start(rng, 3 + difficulty)
    words, cart = _fill(rng, s, difficulty)
    code = rng.choice(sorted(COUPONS)) if difficulty > 1 else None
    if code:
        _coupon_if_it_applies(s, code, cart)
    order = s("checkout")
    extra = f" Use coupon {code} if the cart qualifies." if code else ""
    checklist = [("Finds each product id with search_products before adding it", 1.0),
                 ("Adds exactly the requested quantities", 2.0), ("Checks out exactly once, after filling the cart", 2.0)]
    if code:
        checklist.append((f"Applies {code} only if the subtotal reaches its minimum", 1.0))
    return s.task(f"Buy {words}, then check out.{extra} Tell me the order total.",
                  check=("orders", "cart"), answer=order["total"], checklist=tuple(checklist))


def cheapest(rng: random.Random, difficulty: int) -> Task:
    s = _start(rng, 3 + 2 * difficulty)
    category = rng.choice(sorted({p["category"] for p in s.initial["products"].values()}))
    best = min(s("search_products", query=category)["products"], key=lambda p: p["price"])
    s("add_to_cart", product_id=best["id"], quantity=1)
    order = s("checkout")
    return s.task(f"Buy one unit of the cheapest {category} product and check out. Tell me the order total.",
                  check=("orders", "cart"), answer=order["total"],
                  checklist=((f"Searches the {category} category and compares prices", 1.0),
                             (f"Buys exactly one {best['name']}", 2.0)))


def quote(rng: random.Random, difficulty: int) -> Task:
    s = _start(rng, 3 + difficulty)
    words, cart = _fill(rng, s, difficulty)
    code = rng.choice(sorted(COUPONS))
    cart = _coupon_if_it_applies(s, code, cart)
    return s.task(f"Put {words} in my cart and apply coupon {code} if the cart qualifies, but do not check out. "
                  "What is the cart total?", check=("cart", "coupon", "orders"), answer=cart["total"],
                  checklist=(("Does not call checkout", 2.0), ("Adds exactly the requested quantities", 1.0)))


Shop.families = (buy, cheapest, quote)
