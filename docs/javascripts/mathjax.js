// MathJax 3 for the site: pymdownx.arithmatex (generic mode) wraps the mathematics of the pages and docstrings in
// .arithmatex elements with \( \) and \[ \]; the notebooks' markdown cells (.jp-RenderedMarkdown) keep Jupyter's
// $ and $$. Nothing else on a page is typeset. Re-run after Material's instant navigation swaps the page.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex|jp-RenderedMarkdown",
  },
};

if (typeof document$ !== "undefined") {
  document$.subscribe(() => {
    if (window.MathJax && MathJax.startup && MathJax.typesetPromise) {
      MathJax.startup.output.clearCache();
      MathJax.typesetClear();
      MathJax.texReset();
      MathJax.typesetPromise();
    }
  });
}
