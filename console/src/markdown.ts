// The markdown a model writes, rendered as DOM nodes (never through innerHTML): fenced
// code, headings, lists, quotes, rules and paragraphs; inline code, bold, italics and
// links (http, https and mailto only). Anything else stays the text it was.

import { append, h } from "./dom.js";

/** `text` as a fragment of rendered markdown. */
export function markdown(text: string): DocumentFragment {
  const fragment = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i]!;
    const fence = /^\s*(```+|~~~+)\s*([\w+-]*)/.exec(line);
    if (fence) {
      const close = fence[1]!;
      const body: string[] = [];
      i += 1;
      while (i < lines.length && !lines[i]!.trimStart().startsWith(close)) body.push(lines[i++]!);
      i += 1;
      const code = h("code", fence[2] ? { "data-lang": fence[2] } : {}, body.join("\n"));
      fragment.append(h("pre", {}, code));
      continue;
    }
    if (line.trim() === "") {
      i += 1;
      continue;
    }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    if (heading) {
      const level = Math.min(heading[1]!.length + 2, 6) as 3 | 4 | 5 | 6;
      fragment.append(inline(h(`h${level}`), heading[2]!));
      i += 1;
      continue;
    }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      fragment.append(h("hr"));
      i += 1;
      continue;
    }
    if (/^\s*>/.test(line)) {
      const quoted: string[] = [];
      while (i < lines.length && /^\s*>/.test(lines[i]!)) quoted.push(lines[i++]!.replace(/^\s*>\s?/, ""));
      const quote = h("blockquote");
      quote.append(markdown(quoted.join("\n")));
      fragment.append(quote);
      continue;
    }
    const item = listItem(line);
    if (item) {
      const list = h(item.ordered ? "ol" : "ul");
      while (i < lines.length) {
        const next = listItem(lines[i]!);
        if (!next || next.ordered !== item.ordered) break;
        const entry = [next.text];
        i += 1;
        // Continuation lines: indented, and not a new item.
        while (i < lines.length && /^\s{2,}\S/.test(lines[i]!) && !listItem(lines[i]!)) {
          entry.push(lines[i++]!.trim());
        }
        list.append(inline(h("li"), entry.join(" ")));
      }
      fragment.append(list);
      continue;
    }
    const paragraph: string[] = [];
    while (i < lines.length && lines[i]!.trim() !== "" && !startsBlock(lines[i]!)) {
      paragraph.push(lines[i++]!);
    }
    if (paragraph.length === 0) paragraph.push(lines[i++]!);
    const element = h("p");
    paragraph.forEach((text, n) => {
      if (n > 0) element.append(h("br"));
      inline(element, text);
    });
    fragment.append(element);
  }
  return fragment;
}

function listItem(line: string): { ordered: boolean; text: string } | undefined {
  const bullet = /^\s*[-*+]\s+(.*)$/.exec(line);
  if (bullet) return { ordered: false, text: bullet[1]! };
  const numbered = /^\s*\d{1,9}[.)]\s+(.*)$/.exec(line);
  if (numbered) return { ordered: true, text: numbered[1]! };
  return undefined;
}

function startsBlock(line: string): boolean {
  return /^\s*(```|~~~|#{1,6}\s|>)/.test(line) || listItem(line) !== undefined;
}

/** The inline spans: code first (nothing inside it is markup), then links, bold, italics. */
const INLINE =
  /(`+)([\s\S]*?[^`])\1(?!`)|\[([^\]]+)\]\(([^)\s]+)\)|\*\*([^*]+)\*\*|__([^_]+)__|\*([^*\s][^*]*)\*|\b_([^_\s][^_]*)_\b/g;

/** Appends `text`'s inline markdown to `parent`; returns `parent`. */
export function inline<E extends HTMLElement>(parent: E, text: string): E {
  let at = 0;
  for (const match of text.matchAll(INLINE)) {
    append(parent, text.slice(at, match.index));
    at = match.index + match[0].length;
    const [, , code, label, href, strong, strong2, em, em2] = match;
    if (code !== undefined) {
      parent.append(h("code", {}, code.trim() || code));
    } else if (label !== undefined && href !== undefined) {
      if (/^(https?:|mailto:)/i.test(href)) {
        parent.append(inline(h("a", { href, target: "_blank", rel: "noopener noreferrer" }), label));
      } else {
        append(parent, match[0]);
      }
    } else if (strong !== undefined || strong2 !== undefined) {
      parent.append(inline(h("strong"), (strong ?? strong2)!));
    } else if (em !== undefined || em2 !== undefined) {
      parent.append(inline(h("em"), (em ?? em2)!));
    }
  }
  append(parent, text.slice(at));
  return parent;
}
