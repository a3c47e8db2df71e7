// Markdown to DOM nodes, never through innerHTML: every piece of model text
// becomes a text node, so no markup in it is ever parsed. Covers what chat
// answers use: fenced code, headings, lists, quotes, paragraphs, and inline
// code, bold, italic and http(s) links. Images are left as text: the page
// loads nothing from elsewhere.

const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*)|(\[[^\]\n]+\]\([^)\s]+\))/g;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

function safeUrl(url) {
  try {
    const parsed = new URL(url, window.location.href);
    return parsed.protocol === "http:" || parsed.protocol === "https:" ? parsed.href : null;
  } catch {
    return null;
  }
}

function appendInline(parent, text) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) parent.append(text.slice(last, match.index));
    const token = match[0];
    if (match[1]) {
      const code = el("code");
      code.textContent = token.slice(1, -1);
      parent.append(code);
    } else if (match[2]) {
      const strong = el("strong");
      appendInline(strong, token.slice(2, -2));
      parent.append(strong);
    } else if (match[3]) {
      const em = el("em");
      appendInline(em, token.slice(1, -1));
      parent.append(em);
    } else {
      const close = token.indexOf("](");
      const href = safeUrl(token.slice(close + 2, -1));
      if (href) {
        const a = el("a");
        a.href = href;
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        a.textContent = token.slice(1, close);
        parent.append(a);
      } else {
        parent.append(token);
      }
    }
    last = match.index + token.length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function codeBlock(lang, lines) {
  const pre = el("pre");
  const code = el("code");
  if (lang) code.dataset.lang = lang;
  code.textContent = lines.join("\n");
  const copy = el("button", "copy");
  copy.textContent = "Copy";
  copy.addEventListener("click", () => navigator.clipboard?.writeText(code.textContent));
  pre.append(copy, code);
  return pre;
}

// Returns a DocumentFragment for `text`; an unclosed fence (mid-stream) is still a code block.
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+.-]*)/);
    if (fence) {
      const body = [];
      i++;
      while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) body.push(lines[i++]);
      i++;
      out.append(codeBlock(fence[1], body));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      const h = el("h" + Math.min(heading[1].length + 2, 6));
      appendInline(h, heading[2]);
      out.append(h);
      i++;
      continue;
    }
    const bullet = /^\s*([-*+]|\d+[.)])\s+/;
    if (bullet.test(line)) {
      const ordered = /^\s*\d/.test(line);
      const list = el(ordered ? "ol" : "ul");
      while (i < lines.length && bullet.test(lines[i])) {
        const item = el("li");
        appendInline(item, lines[i].replace(bullet, ""));
        list.append(item);
        i++;
      }
      out.append(list);
      continue;
    }
    if (/^\s*>/.test(line)) {
      const quote = el("blockquote");
      const body = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) body.push(lines[i++].replace(/^\s*>\s?/, ""));
      quote.append(renderMarkdown(body.join("\n")));
      out.append(quote);
      continue;
    }
    if (!line.trim()) {
      i++;
      continue;
    }
    const para = el("p");
    const body = [];
    while (
      i < lines.length &&
      lines[i].trim() &&
      !/^\s*```/.test(lines[i]) &&
      !/^#{1,6}\s/.test(lines[i]) &&
      !bullet.test(lines[i]) &&
      !/^\s*>/.test(lines[i])
    ) {
      body.push(lines[i++]);
    }
    body.forEach((part, k) => {
      if (k) para.append(el("br"));
      appendInline(para, part);
    });
    out.append(para);
  }
  return out;
}
