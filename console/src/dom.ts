// Building DOM nodes without HTML strings: every text goes in as text, so nothing a
// model, a tool or a file says can become markup.

type Child = Node | string | null | undefined | false;
type Attributes = Record<string, string | number | boolean | null | undefined>;

/** An element `tag` with `attributes` (false and null leave one out) and `children`. */
export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attributes: Attributes = {},
  ...children: Child[]
): HTMLElementTagNameMap[K] {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === false || value === null || value === undefined) continue;
    element.setAttribute(name, value === true ? "" : String(value));
  }
  append(element, ...children);
  return element;
}

/** Appends `children` to `parent`, strings as text. */
export function append(parent: Node, ...children: Child[]): void {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    parent.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
  }
}

/** A button that runs `action` on click. */
export function button(label: string, action: () => void, attributes: Attributes = {}): HTMLButtonElement {
  const element = h("button", { type: "button", ...attributes }, label);
  element.addEventListener("click", action);
  return element;
}

/** A number of tokens for people: 1234 → "1,234". */
export function count(value: number): string {
  return value.toLocaleString("en-US");
}
